"""Helpers shared by the scripts/gpu_*.py check-and-time scripts (not a script itself).

The scripts run as `python3 scripts/gpu_x.py` from the repository root, so this folder is sys.path[0] and
`import gpu_common` works; importing it also puts the repository root on sys.path for `moebench`.
Multi-rank timing (gpu_dispatch.py) and in-package timing use moebench.measure.timing.measure instead.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

BYTE_ROOF = 4247e9  # B/s, device-to-device copy on the H200 (GPU.md)
FLOP_ROOF = 714e12  # bf16 dense, measured on the H200 (GPU.md)


def _wall_median(fn: Callable[[], Any], warmup: int, samples: int) -> float:
    """Host wall clock (the CPU interpreter): `warmup` calls, then the median of `samples` timed calls (us)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, samples)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _event_samples(run: Callable[[], Any], reps: int, calls_per_run: int) -> list[float]:
    """us per call of `reps` runs, each bracketed by CUDA events and waited for (so runs do not overlap)."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls_per_run)
    return samples


def time_events(fn: Callable[[], Any], device: torch.device, iters: int, *, warmup: int = 3,
                cpu_samples: int = 1) -> float:
    """Median us per call of `iters` eager calls timed with CUDA events after `warmup` calls.

    On a CPU: one warm-up call, then the median of `cpu_samples` wall-clock calls (a smoke signal only).
    """
    if device.type != "cuda":
        return _wall_median(fn, 1, cpu_samples)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_event_samples(fn, iters, 1))


def time_graph(fn: Callable[[], Any], device: torch.device, unroll: int, reps: int, *, warmup: int = 3,
               fallback: bool = True, cpu_warmup: int = 1, cpu_samples: int | None = None) -> tuple[float, str]:
    """(median us per call, mode): `reps` replays of a CUDA graph holding `unroll` calls (mode "graph").

    Capture happens on a side stream after `warmup` eager calls and one more on that stream (lazy init, allocator
    warm-up). With `fallback`, a call that cannot be captured (e.g. a host sync in an eager reference) is timed
    with CUDA events per call instead, mode "events (<exception>)"; without it the exception propagates.
    On a CPU: `cpu_warmup` calls, then the median of `cpu_samples` (default reps // 10) wall-clock calls, mode
    "wall" (the interpreter is slow: a smoke signal only).
    """
    if device.type != "cuda":
        return _wall_median(fn, cpu_warmup, reps // 10 if cpu_samples is None else cpu_samples), "wall"
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(unroll):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        mode, per_run, run = "graph", unroll, graph.replay
    except Exception as e:
        if not fallback:
            raise
        torch.cuda.synchronize()
        mode, per_run, run = f"events ({type(e).__name__})", 1, fn
    return statistics.median(_event_samples(run, reps, per_run)), mode


def env_line(device: torch.device, *extra: str) -> str:
    """'# <device>, torch <v>, triton <v>[, extra...]': the first line of every script's output."""
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return ", ".join([f"# {name}", f"torch {torch.__version__}", f"triton {triton.__version__}", *extra])


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, right_align: bool = False) -> None:
    """Columns as wide as their widest cell, two spaces apart; `right_align`: every column but the first."""
    widths = [max(len(str(r[i])) for r in [*rows, header]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).rjust(w) if right_align and i else str(c).ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))
