"""The one registry: every timed implementation (kernel variant, stage, dispatch path, layer) is an `Impl`.

Impls are registered by the modules of `moebench.bench` (found by discovery: every module of that package is
imported, none is listed by hand), each with the one decorator:

    @register_impl("topk_softmax.triton", targets=("router", "kernel"), description="...")
    def build(p: Params, ctx: RunContext) -> Case: ...

The runner only ever sees `Impl` and the `Case` its `build` returns; it knows nothing about any particular
kernel. An oblivious impl (the pre-fix behaviour) names the mask-aware impl it is the twin of (`twin_of=`), and
plots and tables pair them by that declaration, never by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moebench.check import CheckResult

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from moebench.measure.cost import PointWork
    from moebench.params import Params

__all__ = ["TARGETS", "RunContext", "CheckResult", "Routing", "Case", "Impl", "register", "register_impl",
           "register_variants", "declare_work", "declared_work", "work_of", "load_all", "get", "all_impls", "BENCH_PACKAGE"]

# Sweep targets. An impl declares which of them it can be timed under.
TARGETS = ("kernel", "router", "stage", "dispatch", "layer", "jit_trace", "serving_trace")

BENCH_PACKAGE = "moebench.bench"  # every module of it registers impls at import
PEERS_PACKAGE = "moebench.peers"  # likewise: library adapters and torch.compile peers


@dataclass
class RunContext:
    """Where a case runs. Single process: rank 0 of 1, group None."""

    device: "torch.device"
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when world_size > 1
    simulated: bool = False  # EP ranks beyond the processes present are computed, not measured
    # what a case keeps across the points of one run (a family's own store under its own key, e.g. the serving
    # trace's measured shapes): one per RunContext, and the runner makes one RunContext per run, so nothing
    # outlives its run or leaks into another
    run_store: dict = field(default_factory=dict)
    # where progress() goes: the runner's progress line (relayed from the point worker); None outside a run
    progress_sink: Callable[[int, int, str, str], None] | None = None
    # the run directory (None outside a run: a profile, a test's own call): where a case may write files of its
    # own beside the records (moebench.traces.step_file); every process of the run gets it, rank 0 writes
    run_dir: Path | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def progress(self, done: int, total: int, what: str, detail: str = "") -> None:
        """A long point's own progress: `done` of `total` `what` (e.g. 3 of 8 "ranks timed"), `detail` naming the
        current one. The runner shows it (elapsed, an estimate of what is left); a no-op outside a run. Cheap
        enough to call per unit of work; never call it inside a timed region."""
        if self.progress_sink is not None:
            self.progress_sink(done, total, what, detail)


@dataclass
class Routing:
    """The routing a case actually produced, for the imbalance figures (never the requested knob).

    `produced` is the [T, K] tensor of global expert ids (-1 = no expert) when the case's routing is an input it
    builds, or a function returning them when a kernel under test computes them (a router): the runner calls it
    after the timing, so the figures come from what the kernel returned, not from an `out` buffer it may ignore."""

    produced: "torch.Tensor | Callable[[], torch.Tensor]"
    is_padding: "torch.Tensor | None"  # [T] bool: which rows are padding (independent of whether it was masked)
    num_experts: int
    ep_size: int = 1

    @property
    def topk_ids(self) -> "torch.Tensor":
        """The ids (a function given as `produced` is called now)."""
        return self.produced() if callable(self.produced) else self.produced


@dataclass
class Case:
    """One built point: inputs allocated, outputs preallocated, ready to be checked and timed.

    `run` is the timed region: it must not allocate large tensors nor synchronise with the host unless the
    path itself does (a2a's count exchange). `check` runs the implementation against its reference on the
    same inputs (poisoning outputs first) and is called before any timing.
    """

    run: Callable[[], Any]
    check: Callable[[], CheckResult] | None = None
    bytes_moved: int = 0  # bytes the implementation must move through device memory (or over the wire)
    flops: int = 0
    bytes_note: str = ""  # what bytes_moved counts, e.g. "payload received incl. own rows"
    roofline_us: float | None = None  # if None the runner computes max(flops/FLOP roof, bytes/copy roof)
    routing: Routing | None = None
    graph_capturable: bool = True  # False: cuda_graph timing falls back to events for this case
    stages: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)  # timed one by one too (layer)
    info: dict[str, Any] = field(default_factory=dict)  # extra record fields (corrupted_rows, capacity, ...)
    nvtx_stage: str = ""  # stage part of the NVTX range name; defaults to the impl's kernel name
    cleanup: Callable[[], None] | None = None
    # run() split into its phases, in order (calling them one after the other does what run() does): the
    # profiler's eager iterations open one NVTX range per phase, `moebench/<stage>/<impl>/<phase>`.
    pipeline: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class Impl:
    """A registered implementation. `name` is `<kernel>.<variant>` (e.g. `topk_softmax.triton`)."""

    name: str
    targets: tuple[str, ...]
    build: Callable[["Params", RunContext], Case]
    description: str = ""
    # Returns None when the impl can run here, else the reason it cannot (missing deep_ep, no CUDA, ...).
    available: Callable[[RunContext], str | None] = lambda ctx: None
    # Returns None when a point is possible for this impl, else why not (checked before anything runs).
    validate: Callable[["Params"], str | None] = lambda p: None
    multi_rank: bool = False  # needs ep_size processes (dispatch paths)
    mask_aware: bool = True  # False for the "oblivious" twins that reproduce pre-fix behaviour
    # The mask-aware impl whose pre-fix behaviour this one reproduces (set on oblivious twins only): plots and
    # tables pair the two by this declaration.
    twin_of: str | None = None
    baseline: bool = False  # the family's reference (plain torch, the judge of every other impl)
    # An outside implementation (a peer): "torch.compile", "torch", "vllm", "sglang", "flashinfer", "deep_gemm",
    # "plugin". None for moebench's own impls. Tables and plots give every impl its ratio to the best peer
    # (moebench.report.peers).
    library: str | None = None
    # A measured ceiling, not an implementation of the op (torch's expert GEMMs alone beside fused_experts): no
    # peer; records at the same point are given their fraction of it (moebench.report.ceiling).
    ceiling: bool = False
    # the library kernel whose launch configs (kernels._details.tuning) the `config` parameter picks for this impl
    tuned_kernel: str | None = None

    @property
    def kernel(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def variant(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else ""


_IMPLS: dict[str, Impl] = {}
_loaded = False


def register(impl: Impl) -> Impl:
    """Add one impl (the decorator below and plugins call this)."""
    if impl.name in _IMPLS:
        raise ValueError(f"impl {impl.name!r} registered twice")
    if "." not in impl.name:
        raise ValueError(f"impl {impl.name!r}: names are <family>.<variant>")
    bad = [t for t in impl.targets if t not in TARGETS]
    if bad:
        raise ValueError(f"impl {impl.name!r}: unknown targets {bad}")
    if impl.ceiling and (impl.library is not None or impl.baseline):
        raise ValueError(f"impl {impl.name!r}: a ceiling is neither a peer nor the family's reference")
    if impl.twin_of is not None and impl.mask_aware:
        raise ValueError(f"impl {impl.name!r}: twin_of is for mask-oblivious twins (mask_aware=False)")
    _IMPLS[impl.name] = impl
    return impl


def register_impl(name: str, *, targets: tuple[str, ...], description: str = "",
                  available: Callable[[RunContext], str | None] | None = None,
                  validate: Callable[["Params"], str | None] | None = None, multi_rank: bool = False,
                  twin_of: str | None = None, baseline: bool = False, library: str | None = None,
                  ceiling: bool = False, tuned_kernel: str | None = None
                  ) -> Callable[[Callable[["Params", RunContext], Case]], Callable[["Params", RunContext], Case]]:
    """Decorator: register `build(p, ctx) -> Case` as the impl `name`. `twin_of` marks a mask-oblivious twin
    (and implies mask_aware=False); `library` marks an outside implementation (a peer); `ceiling` a measured
    ceiling beside the op's impls; `tuned_kernel` names the library kernel whose candidate launch configs the
    point's `config` selects (`moebench tune` times them)."""
    def deco(build: Callable[["Params", RunContext], Case]) -> Callable[["Params", RunContext], Case]:
        kw: dict[str, Any] = {}
        if available is not None:
            kw["available"] = available
        if validate is not None:
            kw["validate"] = validate
        register(Impl(name, targets=tuple(targets), build=build, description=description, multi_rank=multi_rank,
                      mask_aware=twin_of is None, twin_of=twin_of, baseline=baseline, library=library,
                      ceiling=ceiling, tuned_kernel=tuned_kernel, **kw))
        return build
    return deco


def register_variants(family: str, descriptions: dict[str, str], make_build: Callable[[str], Callable], *,
                      targets: tuple[str, ...] = ("kernel",),
                      validate: Callable[["Params"], str | None] | None = None,
                      tuned_kernel: str | None = None) -> None:
    """Register `<family>.<variant>` for each variant of `descriptions`, in its order, built by
    `make_build(variant)`: "torch" is the baseline (the reference), "oblivious" the twin of "<family>.triton",
    and "triton" the impl whose launch configs `tuned_kernel` names."""
    for variant, text in descriptions.items():
        register_impl(f"{family}.{variant}", targets=targets, description=text, validate=validate,
                      twin_of=f"{family}.triton" if variant == "oblivious" else None,
                      baseline=variant == "torch",
                      tuned_kernel=tuned_kernel if variant == "triton" else None)(make_build(variant))


_WORK: dict[str, "PointWork"] = {}


def declare_work(name: str, work: "PointWork") -> None:
    """Declare what one point of a family (`name` = the family: every impl `<family>.*`) or of one impl (`name` =
    `<family>.<variant>`, where it differs from its family's) does, beside the impls: moebench.run.estimate turns it
    into seconds on a device (moebench.measure.cost)."""
    if name in _WORK:
        raise ValueError(f"{name!r} declared its work twice")
    _WORK[name] = work


def declared_work(name: str) -> "PointWork | None":
    """What `name` (a family or one impl) declared so far, or None: for a peer that builds on its family's work."""
    return _WORK.get(name)


def work_of(impl: Impl) -> "PointWork | None":
    """The work declared for `impl`, else for its family; None where neither declared any (an impl registered at run
    time under a family of its own: the estimate counts it as one launch a call and says so)."""
    load_all()
    return _WORK.get(impl.name) or _WORK.get(impl.kernel)


def bench_modules() -> list[str]:
    """The modules of `moebench.bench`, then of `moebench.peers` (the outside implementations, whose adapters build
    on the bench families), each sorted: their order is the order of `moebench list`."""
    mods = []
    for package in (BENCH_PACKAGE, PEERS_PACKAGE):
        pkg = importlib.import_module(package)
        mods += sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return mods


def load_all() -> None:
    """Import every bench module once (registration happens at import); a module that fails to import is an
    error, not a silently smaller registry."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in bench_modules():
        importlib.import_module(mod)
    for impl in _IMPLS.values():
        if impl.twin_of is not None and impl.twin_of not in _IMPLS:
            raise ValueError(f"impl {impl.name!r}: twin_of names {impl.twin_of!r}, which is not registered")


def get(name: str) -> Impl:
    load_all()
    return _IMPLS[name]


def all_impls() -> dict[str, Impl]:
    load_all()
    return dict(_IMPLS)
