"""The cost of a run before it starts: an estimate of each point's time on the chosen device, printed by
`moebench run` (and `--dry-run`) above the table, with a warning past WARN_AFTER_S.

What a point does is what its family declared beside its impls (moebench.registry.declare_work, a
moebench.measure.cost.PointWork): the FLOPs, bytes and launch-equivalents of its timed call, the stages it times
alone, what building it costs beyond the usual (a trace replayed), or, for a family whose point is not one call
timed many times, the whole point. This module knows no family by name; the device's rates (DeviceRates: roofs on a
GPU, the interpreter's or eager torch's rates on a CPU) turn the work into seconds.
A run costs the start of the processes its points run in (the point worker, each group of EP ranks); a point its
overhead (build, check, record), its check (CHECK_CALLS calls), its warm-up and its timed
iterations (cut at timing.max_seconds, as the wall-clock timer cuts them), its stages timed alone, capped at its
point timeout; a point whose impl cannot run here (recorded skipped) costs nothing. It is an estimate within a
factor of two on the bundled sweeps' CPU sizes (tests/run/test_estimate_vs_wall.py): the progress line replaces it
with the measured rate once a point ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench import registry
from moebench.measure.cost import DeviceRates, PointWork
from moebench.measure.roofline import roofs_for
from moebench.params import Point, Timing

WARN_AFTER_S = 30 * 60.0
CHECK_CALLS = 1  # the check's run on poisoned outputs (its torch reference is part of the point's overhead)
# Starting the processes: the command itself (what a user waits for too), the point worker (an interpreter importing
# torch and moebench; CUDA's start on a GPU) and each group of EP ranks (one process per rank; a CPU's two cores start
# them a few at a time)
COMMAND_START_S = 2.0
WORKER_START_S = {"cpu": 2.5, "cuda": 6.0}
RANK_START_S = {"cpu": 2.5, "cuda": 4.0}
UNDECLARED = PointWork(call=lambda p: (0.0, 0.0))  # a family that declared no work: one launch a call


@dataclass(frozen=True)
class RunEstimate:
    total_s: float
    points: int
    capped: int  # points whose estimate reaches their point timeout
    timeout_s: float
    device: str
    undeclared: tuple[str, ...] = ()  # families of the points that declared no work (counted as UNDECLARED)


def _interpreted(impl: registry.Impl, work: PointWork) -> bool:
    """Whether the impl's kernels are Triton ones (run in the interpreter on a CPU), not torch code."""
    return impl.library is None and not impl.baseline and not impl.ceiling and impl.variant not in work.torch_variants


def rates_for(impl: registry.Impl, device: torch.device) -> DeviceRates:
    """The rates `impl`'s code runs at on `device`."""
    if device.type == "cuda":
        return DeviceRates("cuda", roofs_for(torch.cuda.get_device_name(device) if torch.cuda.is_available() else None))
    from moebench.kernels.runtime import interpreting

    work = registry.work_of(impl) or UNDECLARED
    return DeviceRates("interpreter" if interpreting() and _interpreted(impl, work) else "cpu")


def call_s(point: Point, device: torch.device) -> float:
    """Estimated seconds of one call of the point's impl on `device` (a family that declares whole points: 0)."""
    impl = registry.get(point.impl)
    work = registry.work_of(impl) or UNDECLARED
    if work.call is None:
        return 0.0
    return work.call_s(point.params, rates_for(impl, device))


def point_s(point: Point, timing: Timing, device: torch.device) -> float:
    """Estimated seconds of the whole point (uncapped): overhead, check, warm-up, timed iterations, stages."""
    impl = registry.get(point.impl)
    work: PointWork = registry.work_of(impl) or UNDECLARED
    rates = rates_for(impl, device)
    if work.point is not None:
        return rates.point_overhead_s + work.point(point.params, rates)
    c = call_s(point, device)

    def timed(per_call: float) -> float:
        iters = timing.iters * per_call
        if not rates.is_cuda:  # the wall-clock timer stops after max_seconds (at least one iteration)
            iters = min(iters, max(timing.max_seconds, per_call))
        return timing.warmup * per_call + iters

    stages = work.stages_alone * timed(c / work.stages_alone) if work.stages_alone else 0.0
    build = work.build(point.params, rates) if work.build is not None else 0.0
    return rates.point_overhead_s + build + CHECK_CALLS * c + timed(c) + stages


def _world(point: Point) -> int:
    """The processes the point runs in: ep_size ranks for a multi-rank impl at a real EP size, else the worker's one."""
    p = point.params
    return p.ep_size if registry.get(point.impl).multi_rank and p.ep_size > 1 and p.ep_mode == "real" else 1


def _unavailable(points: list[Point], device: torch.device) -> set[str]:
    """The impls of `points` that cannot run here (recorded skipped at once, no cost)."""
    ctx = registry.RunContext(device)
    return {name for name in {pt.impl for pt in points} if registry.get(name).available(ctx)}


def estimate_run(points: list[Point], timing: Timing, device: torch.device) -> RunEstimate:
    from moebench.run.point_worker import point_timeout_s

    timeout = point_timeout_s(timing, device)
    skipped = _unavailable(points, device)
    each = [0.0 if pt.impl in skipped else point_s(pt, timing, device) for pt in points]
    kind = "cuda" if device.type == "cuda" else "cpu"
    worlds = {_world(pt) for pt in points if pt.impl not in skipped}
    start = COMMAND_START_S + (WORKER_START_S[kind] if 1 in worlds else 0.0) + sum(
        w * RANK_START_S[kind] for w in worlds - {1})
    impls = [registry.get(name) for name in {pt.impl for pt in points}]
    undeclared = sorted({impl.kernel for impl in impls if registry.work_of(impl) is None})
    return RunEstimate(total_s=start + sum(min(s, timeout) for s in each), points=len(points),
                       capped=sum(s >= timeout for s in each), timeout_s=timeout, device=str(device),
                       undeclared=tuple(undeclared))




def estimate_lines(est: RunEstimate, sizes: dict | None = None) -> tuple[list[str], str | None]:
    """The `#` lines stating the estimate, and a warning (None under WARN_AFTER_S)."""
    from moebench.run.progress import duration

    text = f"estimate: ~{duration(est.total_s)} for {est.points} points on {est.device} (from each point's work"
    text += " and the device's roofs)" if est.device.startswith("cuda") else " and the CPU's rates)"
    lines = [text]
    if est.undeclared:
        lines.append(f"estimate: {', '.join(est.undeclared)} declare no work per point (counted as one launch a call)")
    if est.capped:
        lines.append(f"estimate: {est.capped} points would reach the point timeout of {duration(est.timeout_s)} "
                     "(recorded failed)")
    warning = None
    if est.total_s > WARN_AFTER_S:
        hint = ""
        if not est.device.startswith("cuda") and sizes and "cpu" in sizes:
            hint = "; `--size cpu` runs this sweep at the shapes it declares for a CPU"
        warning = f"this run is estimated at ~{duration(est.total_s)} on {est.device}, over 30 minutes{hint}"
    return lines, warning
