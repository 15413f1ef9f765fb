"""jit_trace.a2a_fixed: batch-size traces, capacity policies, predicted compiles, the record's info; the Triton
kernels under the interpreter (where the JIT hooks do not fire) and, on a GPU, observed compiles == predicted."""

import math

import pytest
import torch

from moebench import registry
from moebench.bench import jit_trace
from moebench.bench.jit_trace import (capacity_problem, check_trace, predicted_cumulative, run_trace,
                                      trace_batch_sizes)
from moebench.params import Params
from moebench.registry import RunContext
from moebench.traces.distributions import DECODE_MAX_TOKENS

CPU = torch.device("cpu")
# ep_size 1, no padding: every row has a route to the one destination, so a step's max rows == its batch size
TRACE = [5, 17, 5, 40, 1, 17, 33, 2, 40, 9]
BUFFER = 48  # not a power of two: pow2 capacities above it are capped


def small(**kw) -> Params:
    base = dict(hidden=32, num_experts=8, top_k=2, ep_size=1, trace=TRACE, num_max_tokens_per_rank=BUFFER,
                padding_ratio=0.0, mask=True, seed=3)
    base.update(kw)
    return Params(**base)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def distinct_running(values):
    seen, out = set(), []
    for v in values:
        seen.add(v)
        out.append(len(seen))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Batch sizes
# ---------------------------------------------------------------------------------------------------------------

def test_explicit_trace_is_used_as_given():
    assert trace_batch_sizes(small()) == TRACE


@pytest.mark.parametrize("dist", ["uniform", "decode_prefill", "lognormal"])
def test_drawn_traces_are_seeded_and_in_range(dist):
    p = Params(trace_steps=2000, trace_distribution=dist, trace_max_tokens=8192, seed=5)
    sizes = trace_batch_sizes(p)
    assert len(sizes) == 2000 and min(sizes) >= 1 and max(sizes) <= 8192
    assert sizes == trace_batch_sizes(p)
    assert sizes != trace_batch_sizes(Params(trace_steps=2000, trace_distribution=dist, seed=6))
    decode = sum(1 for b in sizes if b <= DECODE_MAX_TOKENS) / len(sizes)
    median = sorted(sizes)[len(sizes) // 2]
    if dist == "uniform":
        assert 3000 < median < 5200 and decode < 0.1
    elif dist == "decode_prefill":
        assert 0.85 < decode < 0.95 and max(sizes) > 4096  # mostly decode, occasional prefill chunks
    else:
        assert 45 < median < 180  # median sqrt(8192) ~ 90.5


# The first draws of each distribution at seed 5 up to 8192 tokens: jit_trace's one stream, and serving_trace's DP
# rank 1 (moebench.traces.distributions), pinned so that a change of any seeded stream is seen.
PINNED_DRAWS = {
    "uniform": ([3842, 41, 5926, 953, 3807, 5243], [741, 4858, 3974, 3895, 1217, 6336]),
    "decode_prefill": ([121, 2, 5581, 30, 195, 12], [152, 39, 316, 343, 7580, 99]),
    "lognormal": ([23, 6, 6, 38, 780, 66], [28, 57, 122, 4288, 1268, 102]),
    "chat": ([25, 24, 35, 10, 56, 1579], [50, 54, 3505, 3, 49, 62]),
    "mixed": ([97, 94, 138, 579, 8176, 95], [200, 215, 3697, 12, 193, 248]),
    "prefill_heavy": ([8192, 6233, 138, 579, 8176, 4325], [2902, 3692, 8192, 8192, 193, 999]),
}


@pytest.mark.parametrize("dist", sorted(PINNED_DRAWS))
def test_drawn_traces_are_the_pinned_streams(dist):
    from moebench.bench.serving_trace import trace_tokens

    one_stream, rank_1 = PINNED_DRAWS[dist]
    p = Params(trace_steps=6, trace_distribution=dist, trace_max_tokens=8192, seed=5)
    assert trace_batch_sizes(p) == one_stream
    steps, _ = trace_tokens(Params(trace_steps=6, trace_distribution=dist, trace_max_tokens=8192, seed=5, dp_size=2))
    assert [steps.steps[j][1] for j in steps.index.tolist()] == rank_1


# ---------------------------------------------------------------------------------------------------------------
# Policies and predictions (torch reference kernels: fast, same capacities)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["exact", "pow2", "max"])
def test_capacities_and_predicted_counts(policy):
    info = run_trace(small(capacity_policy=policy), CPU, use_triton=False)
    info.pop("_last")
    steps = info["trace_steps"]
    assert [s["batch"] for s in steps] == TRACE and [s["step"] for s in steps] == list(range(len(TRACE)))
    assert [s["max_rows"] for s in steps] == TRACE
    expected = {"exact": TRACE, "pow2": [min(next_pow2(b), BUFFER) for b in TRACE], "max": [BUFFER] * len(TRACE)}
    caps = [s["capacity"] for s in steps]
    assert caps == expected[policy]
    predicted = {"exact": len(set(TRACE)), "pow2": len({min(next_pow2(b), BUFFER) for b in TRACE}), "max": 1}
    assert info["predicted_compiles"] == predicted[policy] == len(info["distinct_capacities"])
    assert info["predicted_cumulative"] == distinct_running(caps)
    assert info["distinct_capacities"] == sorted(set(caps))
    assert info["policy"] == policy and info["trace_source"] == "explicit" and info["buffer_rows"] == BUFFER
    assert info["pow2_bound"] == math.ceil(math.log2(BUFFER)) + 1
    # no hooks here: never a misleading 0
    assert info["counting"] is False and info["observed_compiles"] == "unsupported"
    assert all(s["compiles"] is None and s["compile_s"] is None and s["disk_cache_hits"] is None for s in steps)
    assert check_trace(info, small(capacity_policy=policy)).ok


def test_pow2_over_a_long_trace_stays_within_log2_bound():
    p = Params(hidden=16, num_experts=8, top_k=2, ep_size=1, trace_steps=300, trace_distribution="uniform",
               trace_max_tokens=512, num_max_tokens_per_rank=512, capacity_policy="pow2", seed=1)
    info = run_trace(p, CPU, use_triton=False)
    assert set(info["distinct_capacities"]) <= {1 << i for i in range(10)}
    assert info["predicted_compiles"] <= info["pow2_bound"] == 10


def test_mask_changes_exact_capacity():
    """Unmasked padded rows are sent like real ones: the exact capacity grows with the padding."""
    masked = run_trace(small(padding_ratio=0.5, mask=True), CPU, use_triton=False)["trace_steps"]
    unmasked = run_trace(small(padding_ratio=0.5, mask=False), CPU, use_triton=False)["trace_steps"]
    assert [s["capacity"] for s in unmasked] == TRACE
    assert [s["capacity"] for s in masked] == [max(1, b - int(round(b * 0.5))) for b in TRACE]


def test_capacity_is_max_rows_per_destination():
    """ep_size > 1: a step's exact capacity is the most rows any destination gets from the step's routing."""
    from moebench import inputs
    from moebench.dispatch.base import EPLayout, token_in_rank

    p = small(ep_size=4, padding_ratio=0.25, mask=False, trace=[12, 30, 7])
    steps = run_trace(p, CPU, use_triton=False)["trace_steps"]
    for i, b in enumerate([12, 30, 7]):
        sp = Params(**{**p.to_dict(), "num_tokens": b, "trace": None})
        batch = inputs.make_batch(sp, CPU, seed_offset=i)
        _, ids = inputs.route(sp, batch)
        per_dest = token_in_rank(ids.to(torch.int32), EPLayout(0, 4, p.num_experts)).sum(0)
        assert steps[i]["max_rows"] == steps[i]["capacity"] == int(per_dest.max())


def test_check_fails_on_wrong_capacity_or_count():
    p = small(capacity_policy="pow2")
    info = run_trace(p, CPU, use_triton=False)
    info.pop("_last")
    assert check_trace(info, p).ok
    bad = {**info, "trace_steps": [dict(s) for s in info["trace_steps"]]}
    bad["trace_steps"][3]["capacity"] = 40  # max rows 40 needs 48 (capped 64) under pow2
    assert not check_trace(bad, p).ok
    # as if the hooks fired: one compile too many at step 2 (a repeated capacity)
    counted = {**info, "counting": True, "observed_compiles": info["predicted_compiles"] + 1,
               "trace_steps": [dict(s) for s in info["trace_steps"]]}
    new = [b - a for a, b in zip([0] + info["predicted_cumulative"][:-1], info["predicted_cumulative"])]
    for s, n in zip(counted["trace_steps"], new):
        s["compiles"] = n
    assert check_trace(counted, p).ok
    counted["trace_steps"][2]["compiles"] += 1
    res = check_trace(counted, p)
    assert not res.ok and "step 2" in res.detail
    assert capacity_problem("exact", 10, 12, 48) and capacity_problem("max", 10, 16, 48)
    assert capacity_problem("pow2", 10, 12, 48) and capacity_problem("pow2", 40, 64, 48)
    assert capacity_problem("pow2", 33, 48, 48) is None and capacity_problem("exact", 0, 1, 48) is None


def test_predicted_cumulative_counts_new_values():
    assert predicted_cumulative([4, 4, 8, 4, 16, 8]) == [1, 1, 2, 2, 3, 3]


def test_validate():
    impl = registry.get("jit_trace.a2a_fixed")
    assert impl.validate(small()) is None
    assert "trace_max_tokens" in impl.validate(Params(trace_max_tokens=9000, num_max_tokens_per_rank=8192))
    assert "trace" in impl.validate(small(trace=[1, 49]))
    assert "ep_mode" in impl.validate(small(ep_mode="simulated"))
    assert impl.targets == ("jit_trace",)


# ---------------------------------------------------------------------------------------------------------------
# The registered impl with the Triton kernels (interpreter on the CPU), through the runner, and the plot
# ---------------------------------------------------------------------------------------------------------------

def test_registered_case_with_triton_kernels(device):
    p = small(ep_size=2, trace=[6, 11, 6, 3], padding_ratio=0.25, mask=False, capacity_policy="exact")
    case = registry.get("jit_trace.a2a_fixed").build(p, RunContext(device=device))
    res = case.check()
    assert res.ok, res.detail
    assert res.metrics["send_x.mismatches"] == 0 and res.metrics["send_meta.mismatches"] == 0
    info = case.info
    assert [s["capacity"] for s in info["trace_steps"]] == [s["max_rows"] for s in info["trace_steps"]]
    assert info["predicted_compiles"] == len({s["capacity"] for s in info["trace_steps"]})
    if device.type == "cpu":
        assert "unsupported" in res.detail and info["observed_compiles"] == "unsupported"
    case.run()
    assert case.routing.ep_size == 2 and case.bytes_moved > 0 and case.graph_capturable


def test_runner_records_and_jit_plot(tmp_path):
    from moebench.plots import make_plots
    from moebench.run.results import load_records
    from moebench.run.runner import run_sweep
    from moebench.run.sweep import sweep_from_dict

    sweep = sweep_from_dict({
        "name": "jt", "target": "jit_trace", "impls": ["jit_trace.a2a_fixed"],
        "fixed": {"hidden": 32, "num_experts": 8, "top_k": 2, "trace": [3, 9, 3, 5], "num_max_tokens_per_rank": 16},
        "axes": {"capacity_policy": ["exact", "pow2", "max"]},
        "timing": {"warmup": 0, "iters": 1}})
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu")
    make_plots(run_dir, tmp_path / "plots" / run_dir.name)
    recs = sorted(load_records(run_dir), key=lambda r: r["point"])
    assert code == 0 and [r["status"] for r in recs] == ["ok"] * 3
    for r, pred in zip(recs, (3, 3, 1)):
        info = r["info"]
        assert info["predicted_compiles"] == pred and len(info["predicted_cumulative"]) == 4
        assert set(info["trace_steps"][0]) >= {"step", "batch", "capacity", "compiles", "compile_s",
                                                "disk_cache_hits"}
    compiles_plots = list((tmp_path / "plots" / run_dir.name).glob("jit_compiles*.png"))
    if all(r["info"].get("counting") for r in recs):  # JIT hooks fired (GPU): the compiles plot is drawn
        assert compiles_plots
    else:  # the interpreter counts nothing: no plot may pretend zero compiles
        assert not compiles_plots and all(r["info"]["observed_compiles"] == "unsupported" for r in recs)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the hooks fire, observed == predicted
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["exact", "pow2"])
def test_observed_compiles_match_prediction_on_gpu(policy):
    dev = torch.device("cuda")
    p = Params(hidden=256, num_experts=64, top_k=4, ep_size=4, trace_steps=20, trace_distribution="uniform",
               trace_max_tokens=1024, num_max_tokens_per_rank=1024, capacity_policy=policy, seed=11)
    for attempt in range(2):  # the second build starts from fresh kernel copies too (disk cache hits, same count)
        case = registry.get("jit_trace.a2a_fixed").build(p, RunContext(device=dev))
        res = case.check()
        assert res.ok, res.detail
        info = case.info
        assert info["counting"] is True
        assert info["observed_compiles"] == info["predicted_compiles"] >= 1
        assert info["kernel_compiles"] == 2 * info["predicted_compiles"]  # pack and combine, once per capacity
        assert [s["compiles"] for s in info["trace_steps"]] == [
            b - a for a, b in zip([0] + info["predicted_cumulative"][:-1], info["predicted_cumulative"])]
        assert isinstance(info["disk_cache_hits"], int)
        if attempt == 1:
            assert info["disk_cache_hits"] == info["kernel_compiles"]  # built by attempt 0, loaded from disk
        if policy == "pow2":
            assert info["predicted_compiles"] <= info["pow2_bound"]
