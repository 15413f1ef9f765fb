"""The one registry: every timed implementation (kernel variant, stage, dispatch path, layer) is an `Impl`.

A new kernel or dispatch path is one module that calls `register(Impl(...))` at import time, plus one line in
`IMPL_MODULES` below so the runner imports it. The runner only ever sees `Impl` and the `Case` its `build`
returns; it knows nothing about any particular kernel.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from moebench.sweep import Params

# Sweep targets. An impl declares which of them it can be timed under.
TARGETS = ("kernel", "router", "stage", "dispatch", "layer", "jit_trace")

# Modules that register impls. Order only affects `moebench list`.
IMPL_MODULES = (
    "moebench.kernels.topk_softmax",
    "moebench.kernels.grouped_topk",
    "moebench.kernels.prepare_moe_inputs",
    "moebench.kernels.apply_expert_map",
    "moebench.kernels.globalize_recv_topk_idx",
    "moebench.kernels.moe_align_block_size",
    "moebench.kernels.masked_moe_sum",
    "moebench.kernels.fused_experts",
    "moebench.layer",
    "moebench.dispatch.bench",
    "moebench.jit_trace",
    "moebench.simulate",
)


@dataclass
class RunContext:
    """Where a case runs. Single process: rank 0 of 1, group None."""

    device: "torch.device"
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when world_size > 1
    simulated: bool = False  # EP ranks beyond the processes present are computed, not measured

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class CheckResult:
    """Outcome of comparing an implementation against its reference on the case's inputs."""

    ok: bool
    detail: str = ""  # first mismatches, human readable; empty when ok
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"x_q.max_rel": 0.0, "ids.mismatches": 0}

    @staticmethod
    def merge(*results: "CheckResult") -> "CheckResult":
        ok = all(r.ok for r in results)
        detail = "; ".join(r.detail for r in results if r.detail and not r.ok)
        metrics: dict[str, float] = {}
        for r in results:
            metrics.update(r.metrics)
        return CheckResult(ok, detail, metrics)


@dataclass
class Routing:
    """The routing a case actually produced, for the imbalance figures (never the requested knob)."""

    topk_ids: "torch.Tensor"  # [T, K] global expert ids, -1 = no expert
    is_padding: "torch.Tensor | None"  # [T] bool: which rows are padding (independent of whether it was masked)
    num_experts: int
    ep_size: int = 1


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

    @property
    def kernel(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def variant(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else ""


_IMPLS: dict[str, Impl] = {}
_loaded = False


def register(impl: Impl) -> Impl:
    if impl.name in _IMPLS:
        raise ValueError(f"impl {impl.name!r} registered twice")
    bad = [t for t in impl.targets if t not in TARGETS]
    if bad:
        raise ValueError(f"impl {impl.name!r}: unknown targets {bad}")
    _IMPLS[impl.name] = impl
    return impl


def load_all() -> None:
    """Import every impl module once (registration happens at import)."""
    global _loaded
    if _loaded:
        return
    for mod in IMPL_MODULES:  # every module must exist: a missing one is an error, not a silently smaller registry
        importlib.import_module(mod)
    _loaded = True


def get(name: str) -> Impl:
    load_all()
    return _IMPLS[name]


def all_impls() -> dict[str, Impl]:
    load_all()
    return dict(_IMPLS)
