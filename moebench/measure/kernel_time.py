"""GPU kernel time read from torch.profiler: what a call's kernels spend on the GPU, launches and host gaps left out.

measure.timing times a call from the host's side (events around it, or a graph replay). Some figures are defined by
the kernels alone: DeepEP's own tests report its kernels' time (`bench_kineto`), so comparing with them needs the
same measure. `kernel_time` gives it; `top_kernels` lists where a call's GPU time goes. Both need CUDA.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch


def _device_us(event: Any, self_only: bool) -> float:
    """Device time of a profiler key-average in us, across torch's renames (cuda_* -> device_*)."""
    prefix = "self_" if self_only else ""
    t = getattr(event, f"{prefix}device_time_total", None)
    return float(t if t is not None else getattr(event, f"{prefix}cuda_time_total", 0.0))


def _align_gpus(group: Any, device: torch.device) -> Callable[[], None]:
    """A step that lines the ranks up on their GPUs, not only on their hosts: a ~1 ms matmul then a one-element
    all_reduce, so the timed kernels are already queued when the all_reduce ends on every GPU at about the same
    moment (DeepEP's tests do the same: `barrier_comm_profiling`). Without it, a rank whose host arrives late makes
    the other rank's communication kernel spin for the difference."""
    import torch.distributed as dist

    a = torch.randn(4096, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flag = torch.ones(1, device=device)

    def step() -> None:
        dist.barrier(group=group)
        torch.matmul(a, b)
        dist.all_reduce(flag, group=group)
    return step


def kernel_time(fn: Callable[[], Any], device: torch.device, iters: int, match: str, *,
                group: Any = None) -> dict[str, Any]:
    """GPU time per call of the kernels whose name contains `match`, over `iters` profiled calls after one warm-up.

    With `group` (several ranks, every one calling this): ranks are lined up on their GPUs before each call (see
    _align_gpus), and the result is the slowest rank's mean (`p50_us`, as every multi-rank moebench figure), the
    fastest (`min_us`), the mean over ranks (`mean_us`, what DeepEP prints per rank) and `slowest_rank`. A rank
    that sees no matching kernel reports NaN and names the kernels it did see on stderr: never a zero as a time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        raise ValueError("kernel_time needs a CUDA device")
    align = _align_gpus(group, device) if group is not None else None
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if align is not None:
                align()
            fn()
        torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(_device_us(e, self_only=False) for e in events if match in e.key)
    if total == 0:
        names = sorted({e.key[:60] for e in events})
        print(f"kernel_time: no GPU kernel named *{match}* among {names[:8]}", file=sys.stderr)
        total = float("nan")
    mine = total / iters
    if group is None:
        return {"p50_us": mine, "min_us": mine, "mean_us": mine, "slowest_rank": 0}
    import torch.distributed as dist

    per_rank = torch.tensor([mine], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(per_rank) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, per_rank, group=group)
    vals = [float(g) for g in gathered]
    worst = max(range(len(vals)), key=vals.__getitem__)
    return {"p50_us": vals[worst], "min_us": min(vals), "mean_us": sum(vals) / len(vals), "slowest_rank": worst}


def top_kernels(fn: Callable[[], Any], device: torch.device, iters: int = 5, top: int = 12, *,
                group: Any = None) -> list[tuple[str, float, float]]:
    """(name, calls per call of fn, self device us per call of fn) of the `top` busiest GPU kernels / ops of fn,
    profiled over `iters` calls after one warm-up; with `group`, the ranks meet at a barrier before each call."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        raise ValueError("top_kernels needs a CUDA device")
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if group is not None:
                import torch.distributed as dist

                dist.barrier(group=group)
            fn()
        torch.cuda.synchronize(device)
    rows = [(e.key, e.count / iters, _device_us(e, self_only=True) / iters) for e in prof.key_averages()]
    rows = [r for r in rows if r[2] > 0]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]
