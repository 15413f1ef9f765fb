"""NVTX ranges around the timed work.

Every timed piece runs inside `nvtx_range(range_name(stage, impl))`, i.e. a range named `moebench/<stage>/<impl>`,
so an nsys timeline reads like the MoE pipeline; while a torch.profiler session records, the same names appear
there as record_function ranges (what `moebench profile` summarises).

`profiled_iterations` is what `moebench profile` captures: the point's run() as eager launches, each call inside
the point's range and, when the case declares its pipeline, each phase inside `<point range>/<phase>` (e.g.
`moebench/layer/layer.masked/experts`). Eager, not graph replays: a replay is one launch inside one range, so
nothing would tell the profiler which stage a kernel belongs to. These iterations run after the timed ones and
are not timed: the timed samples and their ranges are the same as in `moebench run`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

RANGE_PREFIX = "moebench/"
EAGER_LAUNCHES = "eager launches"  # how the profiled iterations launch their work (the summary says so)


def range_name(stage: str, impl: str) -> str:
    """`moebench/<stage>/<impl>`; an empty stage defaults to the impl's kernel name (as Case.nvtx_stage does)."""
    if not impl:
        raise ValueError("range_name: impl must be a non-empty name")
    return f"{RANGE_PREFIX}{stage or impl.split('.', 1)[0]}/{impl}"


def stage_range_name(point_range: str, stage: str) -> str:
    """`<point range>/<stage>`: a pipeline stage's range, nested under the point's range."""
    if not stage:
        raise ValueError("stage_range_name: stage must be a non-empty name")
    return f"{point_range}/{stage}"


def _noop(*_args: Any) -> None:
    return None


def _select_backend(prefer: str | None = None) -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    """(backend name, push(name), pop()): the `nvtx` package, else torch.cuda.nvtx on CUDA, else no-op.

    `prefer` forces one of "nvtx", "torch", "none" (tests); an unusable choice falls through to the next one.
    """
    order = ("nvtx", "torch", "none")
    start = order.index(prefer) if prefer in order else 0
    for choice in order[start:]:
        if choice == "nvtx":
            try:
                import nvtx  # type: ignore[import-not-found]

                return "nvtx", (lambda name: nvtx.push_range(message=name)), nvtx.pop_range
            except Exception:  # not installed, or its native library failed to load
                continue
        if choice == "torch":
            try:
                import torch

                if torch.cuda.is_available():
                    return "torch.cuda.nvtx", torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
            except Exception:
                continue
    return "none", _noop, _noop


@lru_cache(maxsize=1)
def _backend() -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    return _select_backend()


def nvtx_backend() -> str:
    """Which NVTX backend nvtx_range uses here: "nvtx", "torch.cuda.nvtx" or "none"."""
    return _backend()[0]


@lru_cache(maxsize=1)
def _profiler_flag() -> Callable[[], bool]:
    """The cheapest available 'is a torch.profiler session recording?' check, resolved once."""
    try:
        import torch

        flag = torch._C._autograd._profiler_enabled
        flag()
        return flag
    except Exception:  # pragma: no cover - private API moved, or no torch
        try:
            import torch.autograd.profiler as ap

            return lambda: bool(getattr(ap, "_is_profiler_enabled", False))
        except Exception:
            return lambda: False


def _torch_profiler_enabled() -> bool:
    return bool(_profiler_flag()())


class nvtx_range:
    """Context manager: an NVTX push/pop range around the block.

    While a torch.profiler session is recording it also opens a `record_function` of the same name, so the
    torch.profiler fallback sees the same `moebench/...` ranges that nsys would. Outside a profiler session that
    costs nothing but one flag read (the timed loops stay lean).
    """

    __slots__ = ("name", "_pop", "_record")

    def __init__(self, name: str):
        self.name = name
        self._pop: Callable[[], Any] = _noop
        self._record: Any = None

    def __enter__(self) -> "nvtx_range":
        _, push, pop = _backend()
        push(self.name)
        self._pop = pop
        if _torch_profiler_enabled():
            from torch.autograd.profiler import record_function

            self._record = record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._record is not None:
                self._record.__exit__(exc_type, exc, tb)
                self._record = None
        finally:
            self._pop()


def profiled_iterations(run: Callable[[], Any], pipeline: Sequence[tuple[str, Callable[[], Any]]],
                        point_range: str, iters: int, device: Any = None,
                        hook: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`iters` eager calls of the point, each inside `point_range`; with a pipeline, its phases are called in
    order instead of run(), each inside `stage_range_name(point_range, phase)`. `hook("start"/"stop")` brackets
    the calls (the profiler's capture range); the device is synchronised before "stop", so every launched kernel
    is inside the capture. Returns what ran: {"iterations", "launch", "point_range", "stage_ranges"}."""
    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    steps = [(stage_range_name(point_range, name), fn) for name, fn in pipeline]
    if cuda:
        torch.cuda.synchronize(device)
    if hook:
        hook("start")
    for _ in range(iters):
        with nvtx_range(point_range):
            if not steps:
                run()
            for name, fn in steps:
                with nvtx_range(name):
                    fn()
    if cuda:
        torch.cuda.synchronize(device)
    if hook:
        hook("stop")
    return {"iterations": iters, "launch": EAGER_LAUNCHES, "point_range": point_range,
            "stage_ranges": [name for name, _ in steps]}
