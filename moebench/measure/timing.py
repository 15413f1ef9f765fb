"""Latency measurement: CUDA events, CUDA-graph replay, or host wall clock (CPU).

Every sample is kept. Statistics: p50, p10, p90, min, max, mean, cv. Multi-rank: per iteration the max over
ranks, then statistics; the slowest rank is the one most often attaining that max.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moebench.measure.nvtx import nvtx_range
from moebench.params import Timing


@dataclass
class TimingResult:
    mode: str  # the mode actually used: "cuda_graph" | "events" | "wall"
    samples_us: list[float]
    stats: dict[str, float]
    note: str = ""  # why the requested mode was changed, if it was
    ranks: dict[str, Any] | None = field(default=None)
    unroll: int = 1  # calls per graph replay actually used (auto mode may raise it: see choose_unroll)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    n = len(s)
    if n == 0:
        return {"n": 0}
    mean = sum(s) / n
    var = sum((x - mean) ** 2 for x in s) / n
    return {"n": n, "p50": percentile(s, 50), "p10": percentile(s, 10), "p90": percentile(s, 90), "min": s[0],
            "max": s[-1], "mean": mean, "cv": (math.sqrt(var) / mean) if mean > 0 else 0.0}


def resolve_mode(requested: str, device: torch.device, graph_capturable: bool) -> tuple[str, str]:
    """(mode to use, note). `auto` picks cuda_graph on a GPU when the case allows it, wall clock on a CPU."""
    if device.type != "cuda":
        note = "" if requested in ("auto", "wall") else f"{requested} needs CUDA: wall clock used on {device.type}"
        return "wall", note
    if requested == "auto":
        return ("cuda_graph", "") if graph_capturable else ("events", "case is not graph-capturable")
    if requested == "cuda_graph" and not graph_capturable:
        return "events", "case is not graph-capturable (host sync or dynamic shapes): events used"
    return requested, ""


# `auto` on a GPU: one graph replay must last long enough that its launch (tens of microseconds of host time) is hidden,
# as triton.testing.do_bench_cudagraph does by capturing many calls. Calls per replay are chosen from one timed
# eager call so that a replay lasts at least AUTO_REPLAY_US, at most AUTO_MAX_UNROLL calls.
AUTO_REPLAY_US = 500.0
AUTO_MAX_UNROLL = 100


def choose_unroll(call_us: float) -> int:
    """Calls per graph replay for a call of `call_us` microseconds (auto mode)."""
    if not call_us > 0:
        return AUTO_MAX_UNROLL
    return max(1, min(AUTO_MAX_UNROLL, math.ceil(AUTO_REPLAY_US / call_us)))


def _one_call_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median of three event-timed eager calls (after warm-up): the estimate auto-unroll works from."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[1]


def _range(range_name: str | None):
    if not range_name:
        return nullcontext()
    return nvtx_range(range_name)


def measure(fn: Callable[[], Any], timing: Timing, device: torch.device, *, graph_capturable: bool = True,
            range_name: str | None = None, group: Any = None, barrier: bool = False,
            hook: Callable[[str], None] | None = None) -> TimingResult:
    """Warm up, then time `fn` timing.iters times (stopping early after timing.max_seconds).

    `group`: a torch.distributed group; samples are then reduced to the per-iteration max over ranks (every rank
    must call measure with the same timing). `barrier`: synchronise ranks before each iteration so that the
    per-iteration max measures one collective step. `hook("start"/"stop")` brackets the timed iterations (used by
    the profiler to start/stop the capture range).
    """
    mode, note = resolve_mode(timing.mode, device, graph_capturable)
    world = _world_size(group)
    for _ in range(timing.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    unroll = timing.unroll
    if mode == "cuda_graph" and timing.mode == "auto" and timing.unroll == 1 and world == 1:
        # single process only: a multi-rank replay stays one collective step so its per-iteration max means one step
        unroll = choose_unroll(_one_call_us(fn, device))
        note = f"auto: {unroll} calls per replay"
    if mode == "cuda_graph":
        # multi-rank: every rank captures its step, collectives included, and the replays are lined up by a
        # barrier like eager steps (a serving engine replays such a step as a graph: no host launch costs)
        samples = _time_graph(fn, timing, device, range_name, hook, group if barrier else None, unroll)
    elif mode == "events":
        samples = _time_events(fn, timing, device, range_name, group if barrier else None, hook)
    else:
        samples = _time_wall(fn, timing, device, range_name, group if barrier else None, hook)

    ranks = None
    if world > 1:
        samples, ranks = reduce_over_ranks(samples, group, device)
    return TimingResult(mode=mode, samples_us=samples, stats=summarize(samples), note=note, ranks=ranks,
                        unroll=unroll if mode == "cuda_graph" else 1)


def _world_size(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _sync_ranks(group: Any, device: torch.device) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _event_samples(step, timing: Timing, device, range_name, group, hook) -> list[float]:
    """Time `step` timing.iters times with CUDA events (each inside the NVTX range); ms -> us."""
    n = timing.iters
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    deadline = time.perf_counter() + timing.max_seconds
    done = 0
    if hook:
        hook("start")
    for i in range(n):
        if group is not None:
            _sync_ranks(group, device)
        with _range(range_name):
            starts[i].record()
            step()
            ends[i].record()
        done = i + 1
        # Ranks must take the same number of samples, so only a single process stops early.
        if group is None and time.perf_counter() > deadline:
            break
    torch.cuda.synchronize(device)
    if hook:
        hook("stop")
    return [starts[i].elapsed_time(ends[i]) * 1e3 for i in range(done)]


def _time_events(fn, timing: Timing, device, range_name, group, hook) -> list[float]:
    return _event_samples(fn, timing, device, range_name, group, hook)


def _time_graph(fn, timing: Timing, device, range_name, hook, group=None, unroll: int | None = None) -> list[float]:
    # Capture on a side stream as torch requires; `unroll` calls per graph amortise the replay launch.
    # Thread-local capture: a process group's watchdog thread keeps querying its events meanwhile.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # one more eager call on the capture stream (lazy init, allocator warm-up)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    unroll = timing.unroll if unroll is None else unroll
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for _ in range(unroll):
            fn()
    if group is not None:
        _sync_ranks(group, device)
    graph.replay()
    torch.cuda.synchronize(device)
    samples = _event_samples(graph.replay, timing, device, range_name, group, hook)
    del graph
    return [s / unroll for s in samples]


def _time_wall(fn, timing: Timing, device, range_name, group, hook) -> list[float]:
    samples = []
    deadline = time.perf_counter() + timing.max_seconds
    cuda = device.type == "cuda"
    if hook:
        hook("start")
    for _ in range(timing.iters):
        if group is not None:
            _sync_ranks(group, device)
        with _range(range_name):
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - t0) * 1e6)
        if group is None and time.perf_counter() > deadline:
            break
    if hook:
        hook("stop")
    return samples


# measure_settled: where a call's launches hide behind the GPU, and when its samples have settled
EAGER_ABOVE_US = 400.0  # above this a call's launches (~10 kernels, ~150 us of host time) queue ahead of the GPU
# ... provided the host launched them in at most this share of the call's event time (else the events timed the host)
EAGER_HOST_SHARE = 0.5
SETTLED_REPLAY_US = 200.0  # a graph replay lasts at least this long (calls per graph: ceil(this / call))
SETTLED_MAX_GRAPH_CALLS = 16
SETTLED_ROUND = 5
SETTLED_SPREAD = 0.005  # half the p10-p90 spread over the median at which sampling stops
# sampling also stops once the samples add up to this: a call of milliseconds (a prefill-sized grouped GEMM) is
# GPU-bound and steady, and its rounds of 5 would otherwise cost a tenth of a second each to tighten a spread
# that clocks and power, not the sample count, decide
SETTLED_SAMPLED_US = 50_000.0


def relative_spread(samples: list[float]) -> float:
    """Half the p10-p90 spread over the median."""
    s = sorted(samples)
    p50 = percentile(s, 50)
    return (percentile(s, 90) - percentile(s, 10)) / 2 / p50 if p50 > 0 else 0.0


@dataclass
class Settled:
    us: float  # the median sample
    mode: str  # "events" (eager calls back to back) or "cuda_graph"
    samples: int
    spread: float  # relative_spread of the samples
    calls_per_sample: int = 1
    host_us: float | None = None  # the host's time to launch one call (what decided the mode)


def measure_settled(fn: Callable[[], Any], device: torch.device, max_samples: int = 20, *, pool: Any = None
                    ) -> Settled:
    """GPU time of one call of `fn`, at the least cost that still gives a settled median: one untimed call
    (compiles a new specialisation, warms the launch; no further warm-up), one event-timed call to choose the mode,
    then samples in rounds of SETTLED_ROUND until their relative spread is within SETTLED_SPREAD or they add up to
    SETTLED_SAMPLED_US (at most `max_samples`). A call is timed eagerly (calls back to back, an event between each)
    only where it is GPU-bound: EAGER_ABOVE_US or more between its events and its launches done on the host in at
    most EAGER_HOST_SHARE of that. Any other call is captured in a CUDA graph of enough calls to last
    SETTLED_REPLAY_US (in the memory pool `pool` when given: many graphs of one run share it) and its replays are
    the samples: a call whose launches take as long as its kernels (a Python-heavy layer on a few rows) would
    otherwise time the host, not the GPU. For the many timings of one point (the serving trace's shapes and rank
    workloads); a point's own run uses measure()."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize(device)
    call_us = start.elapsed_time(end) * 1e3
    eager = call_us >= EAGER_ABOVE_US and host_us <= EAGER_HOST_SHARE * call_us
    graph, calls = None, 1
    if not eager:
        if host_us > EAGER_HOST_SHARE * call_us:  # the events timed the launches: one replay times the kernels
            graph = _captured(fn, device, 1, pool)
            call_us = _replay_us(graph, device)
        calls = max(1, min(SETTLED_MAX_GRAPH_CALLS, math.ceil(SETTLED_REPLAY_US / max(call_us, 1.0))))
        if calls > 1 or graph is None:  # a one-call graph already captured is the one to replay
            graph = None  # freed before its longer successor is captured in the same pool
            graph = _captured(fn, device, calls, pool)
    step = graph.replay if graph is not None else fn
    samples: list[float] = []
    most = max(SETTLED_ROUND, max_samples)
    while len(samples) < most:
        n = min(SETTLED_ROUND, most - len(samples))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):  # back to back: each call's end is the next one's start
            step()
            events[i + 1].record()
        torch.cuda.synchronize(device)
        samples += [events[i].elapsed_time(events[i + 1]) * 1e3 / calls for i in range(n)]
        if relative_spread(samples) <= SETTLED_SPREAD or sum(samples) * calls >= SETTLED_SAMPLED_US:
            break
    del graph
    return Settled(percentile(sorted(samples), 50), "events" if eager else "cuda_graph", len(samples),
                   relative_spread(samples), calls, round(host_us, 3))


def _captured(fn: Callable[[], Any], device: torch.device, calls: int, pool: Any) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `calls` calls of fn (in `pool` when given), replayed once to load it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    return graph


def _replay_us(graph: "torch.cuda.CUDAGraph", device: torch.device, replays: int = 3) -> float:
    """The median of a few event-timed replays of a graph (its kernels' time, the launches gone)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    events[0].record()
    for i in range(replays):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize(device)
    return percentile(sorted(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(replays)), 50)


def wall_seconds(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn's result and the wall seconds from its call until the device has finished its work: the host's cost of a
    step of a benchmark (a build, a compile, a whole settled timing), not a kernel's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def host_call_us(fn: Callable[[], Any], device: torch.device, iters: int = 200, *, warmup: int = 5,
                 sync_every: int = 50) -> float:
    """Median host microseconds one call of `fn` takes to return, the device left to run behind it (a launch's
    host cost: no sync between calls, one every `sync_every` calls so the launch queue never fills)."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        if cuda and i % sync_every == sync_every - 1:
            torch.cuda.synchronize(device)
    if cuda:
        torch.cuda.synchronize(device)
    return summarize(samples)["p50"]


def marked_calls(fn: Callable[[], Any], timer: Any, iters: int, device: torch.device, *,
                 group: Any = None) -> list[dict[str, Any]]:
    """`iters` calls of fn, each between timer.begin() and timer.end(), ranks synchronised before each when
    `group` is given; returns timer.table(). The timer (moebench.dispatch.base.StageTimer) holds the marks the code
    under fn records at its named sub-steps: the GPU and host time of each since the call's start."""
    for _ in range(iters):
        if group is not None:
            _sync_ranks(group, device)
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
        timer.begin()
        fn()
        timer.end()
    return timer.table()


def reduce_over_ranks(samples: list[float], group: Any, device: torch.device) -> tuple[list[float], dict]:
    """Per-iteration max over ranks. Ranks may have taken different sample counts (early stop); the common prefix
    is used. Returns (max samples, {"world_size", "slowest_rank", "per_rank_p50_us", "slowest_share"})."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    comm_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    n_local = torch.tensor([len(samples)], dtype=torch.int64, device=comm_device)
    dist.all_reduce(n_local, op=dist.ReduceOp.MIN, group=group)
    n = int(n_local.item())
    mine = torch.tensor(samples[:n], dtype=torch.float64, device=comm_device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # [R, n]
    if n == 0:
        return [], {"world_size": world, "slowest_rank": 0, "per_rank_p50_us": [float("nan")] * world}
    max_vals, argmax = table.max(dim=0)
    counts = torch.bincount(argmax, minlength=world)
    slowest = int(counts.argmax())
    per_rank_p50 = [summarize(table[r].tolist())["p50"] for r in range(world)]
    return max_vals.tolist(), {"world_size": world, "slowest_rank": slowest, "per_rank_p50_us": per_rank_p50,
                               "slowest_share": float(counts[slowest]) / n}
