"""Measurement core: statistics, mode resolution, wall-clock sampling, per-iteration max over ranks (gloo)."""

import math

import pytest
import torch

from moebench.measure import nvtx
from moebench.measure.timing import measure, percentile, reduce_over_ranks, resolve_mode, summarize
from moebench.params import Timing


def test_summarize_hand_computed():
    st = summarize([4.0, 1.0, 3.0, 2.0, 10.0])
    assert st["n"] == 5 and st["p50"] == 3.0 and st["min"] == 1.0 and st["max"] == 10.0
    assert st["mean"] == 4.0
    assert math.isclose(st["p10"], 1.4) and math.isclose(st["p90"], 7.6)  # linear interpolation
    assert math.isclose(st["cv"], math.sqrt(((0 + 9 + 1 + 4 + 36) / 5)) / 4.0)
    assert summarize([]) == {"n": 0}
    assert percentile([5.0], 90) == 5.0


def test_resolve_mode():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", cpu, True) == ("wall", "")
    mode, note = resolve_mode("cuda_graph", cpu, True)
    assert mode == "wall" and "needs CUDA" in note
    assert resolve_mode("auto", gpu, True) == ("cuda_graph", "")
    assert resolve_mode("auto", gpu, False)[0] == "events"
    mode, note = resolve_mode("cuda_graph", gpu, False)
    assert mode == "events" and "not graph-capturable" in note
    assert resolve_mode("events", gpu, True) == ("events", "")


def test_wall_mode_keeps_every_sample_and_warms_up():
    calls = []
    res = measure(lambda: calls.append(1), Timing(mode="auto", warmup=3, iters=7), torch.device("cpu"))
    assert res.mode == "wall" and len(res.samples_us) == 7 and len(calls) == 10
    assert res.stats["n"] == 7 and all(s >= 0 for s in res.samples_us)


def test_max_seconds_stops_sampling_early():
    import time

    res = measure(lambda: time.sleep(0.02), Timing(warmup=0, iters=1000, max_seconds=0.1), torch.device("cpu"))
    assert 1 <= len(res.samples_us) < 20


def test_each_timed_iteration_runs_inside_its_nvtx_range(monkeypatch):
    events = []
    monkeypatch.setattr(nvtx, "_backend", lambda: ("fake", lambda n: events.append("push " + n),
                                                   lambda: events.append("pop")))
    name = nvtx.range_name("route", "topk_softmax.torch")
    measure(lambda: events.append("run"), Timing(warmup=2, iters=3), torch.device("cpu"), range_name=name)
    # warm-up calls stay outside the range; each timed call sits inside one push/pop
    assert events == ["run", "run"] + ["push moebench/route/topk_softmax.torch", "run", "pop"] * 3
    events.clear()
    measure(lambda: events.append("run"), Timing(warmup=0, iters=2), torch.device("cpu"))
    assert events == ["run", "run"]  # no range name: no range


def _rank_main(ctx):
    # rank r's sample i is 10*i + r, except that rank 0 is slowest on iteration 2; rank 1 took one more sample
    samples = [10.0 * i + ctx.rank for i in range(4 + ctx.rank)]
    if ctx.rank == 0:
        samples[2] = 100.0
    return reduce_over_ranks(samples, ctx.group, torch.device("cpu"))


def test_reduce_over_ranks_per_iteration_max_gloo(gloo_ranks):
    for maxed, info in gloo_ranks.run(_rank_main, 2, timeout_s=120):
        # common prefix of 4 samples; per iteration the max over ranks
        assert maxed == [1.0, 11.0, 100.0, 31.0]
        assert info["world_size"] == 2
        assert info["slowest_rank"] == 1  # attains the max on 3 of 4 iterations
        assert info["slowest_share"] == pytest.approx(0.75)
        assert info["per_rank_p50_us"][1] == pytest.approx(16.0)  # of the common prefix, not its 5 samples


def test_choose_unroll_hides_the_replay_launch():
    from moebench.measure.timing import AUTO_MAX_UNROLL, AUTO_REPLAY_US, choose_unroll

    assert choose_unroll(2.8) == min(AUTO_MAX_UNROLL, math.ceil(AUTO_REPLAY_US / 2.8))  # 2.8 us: capped
    assert choose_unroll(20.0) == math.ceil(AUTO_REPLAY_US / 20.0)
    assert choose_unroll(AUTO_REPLAY_US * 2) == 1  # long calls are replayed alone
    assert choose_unroll(100.0) == 5
    assert choose_unroll(0.0) == AUTO_MAX_UNROLL


@pytest.mark.gpu
def test_auto_mode_unrolls_a_short_kernel_and_says_so(monkeypatch):
    import torch

    from moebench.measure import timing
    from moebench.measure.timing import measure
    from moebench.params import Timing

    # the call's measured length is pinned short: the GPU suite runs on workers sharing one card, where another
    # worker's kernels can stretch an event-timed call (the choice itself is tested on the CPU: choose_unroll)
    monkeypatch.setattr(timing, "_one_call_us", lambda fn, device: 5.0)
    x = torch.randn(1024, device="cuda")
    res = measure(lambda: x.mul_(1.0), Timing(mode="auto", warmup=2, iters=5), torch.device("cuda"))
    assert res.mode == "cuda_graph" and res.unroll > 1 and f"{res.unroll} calls per replay" in res.note
    fixed = measure(lambda: x.mul_(1.0), Timing(mode="cuda_graph", warmup=2, iters=5, unroll=3), torch.device("cuda"))
    assert fixed.unroll == 3 and fixed.note == ""


def test_host_call_us_is_the_median_host_time_of_a_call():
    import time

    from moebench.measure.timing import host_call_us

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.002)
    us = host_call_us(slow, torch.device("cpu"), iters=9, warmup=2)
    assert len(calls) == 11 and 1500 <= us < 50_000


def test_marked_calls_brackets_every_call_and_returns_the_timer_table():
    from moebench.dispatch.base import StageTimer
    from moebench.measure.timing import marked_calls

    timer = StageTimer("cpu")
    table = marked_calls(lambda: timer.mark("inside"), timer, 4, torch.device("cpu"))
    assert len(timer.calls) == 4 and [r["label"] for r in table] == ["start", "inside", "end"]
    assert table[0]["host_us"] == 0 and table[2]["host_us"] >= table[1]["host_us"] >= 0
    assert all(r["gpu_us"] is None for r in table)  # no CUDA: host clock only


def test_profiler_kernel_times_need_cuda():
    from moebench.measure.kernel_time import kernel_time, top_kernels

    with pytest.raises(ValueError, match="CUDA"):
        kernel_time(lambda: None, torch.device("cpu"), 2, "x")
    with pytest.raises(ValueError, match="CUDA"):
        top_kernels(lambda: None, torch.device("cpu"))


@pytest.mark.gpu
def test_kernel_time_reads_the_matching_kernels_only():
    from moebench.measure.kernel_time import kernel_time, top_kernels

    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    res = kernel_time(lambda: a @ a, dev, 5, "gemm")
    assert res["p50_us"] > 0 and res["slowest_rank"] == 0
    nothing = kernel_time(lambda: a @ a, dev, 2, "no_such_kernel_name")
    assert math.isnan(nothing["p50_us"])  # never a zero as a time
    assert top_kernels(lambda: a @ a, dev, iters=2, top=3)


@pytest.mark.gpu
def test_measure_settled_graphs_a_short_call_and_times_a_long_one_eagerly():
    from moebench.measure.timing import EAGER_ABOVE_US, measure_settled

    dev = torch.device("cuda")
    small = torch.randn(256, device=dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    short = measure_settled(lambda: small.mul_(1.0), dev, 20, pool=torch.cuda.graph_pool_handle())
    assert short.mode == "cuda_graph" and short.calls_per_sample > 1 and 5 <= short.samples <= 20
    long = measure_settled(lambda: a @ a, dev, 20)
    assert long.us >= EAGER_ABOVE_US and long.mode == "events" and long.calls_per_sample == 1
    assert long.samples % 5 == 0 and long.spread >= 0


@pytest.mark.gpu
def test_measure_settled_times_a_host_bound_call_by_its_graph_replay():
    """A call whose host work outlasts its kernels (a Python-heavy layer on a few rows) spans EAGER_ABOVE_US between
    its events, but that is the host's time: it is captured and its replays timed."""
    import time

    from moebench.measure.timing import EAGER_ABOVE_US, measure_settled

    dev = torch.device("cuda")
    small = torch.randn(256, device=dev)

    def host_heavy():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2 * EAGER_ABOVE_US * 1e-6:  # the host's launch work, spun
            pass
        small.mul_(1.0)

    got = measure_settled(host_heavy, dev, 20, pool=torch.cuda.graph_pool_handle())
    assert got.mode == "cuda_graph" and got.host_us >= 2 * EAGER_ABOVE_US
    assert got.us < EAGER_ABOVE_US / 4  # one tiny kernel, not the host's spin
    assert got.calls_per_sample > 1  # the calls per graph chosen by the replayed time, not the host's


@pytest.mark.gpu
def test_measure_settled_stops_sampling_a_call_of_milliseconds_after_one_round():
    from moebench.measure.timing import SETTLED_ROUND, SETTLED_SAMPLED_US, measure_settled

    dev = torch.device("cuda")
    a = torch.randn(16384, 16384, device=dev, dtype=torch.bfloat16)  # ~9 TFLOP: over 10 ms a call on an H100/H200
    got = measure_settled(lambda: a @ a, dev, 20)
    assert got.us * SETTLED_ROUND >= SETTLED_SAMPLED_US and got.samples == SETTLED_ROUND


def test_wall_seconds_returns_the_result_and_the_calls_wall_time():
    import time

    from moebench.measure.timing import wall_seconds

    out, seconds = wall_seconds(lambda: (time.sleep(0.02), 7)[1], torch.device("cpu"))
    assert out == 7 and 0.02 <= seconds < 1.0
