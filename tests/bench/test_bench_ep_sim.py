"""ep_mode: simulated (ep_sim.experts): per-rank loads equal the imbalance computed from the routing, masked
repeat-padding equals the real tokens alone, unmasked padding piles up; the registered case end to end."""

import pytest
import torch

from moebench import registry
from moebench.measure.imbalance import imbalance, per_rank_loads
from moebench.params import Params
from moebench.registry import RunContext
from moebench.bench.ep_sim import rank_work, simulated_batches

CPU = torch.device("cpu")


def sim_params(**kw) -> Params:
    base = dict(num_tokens=16, hidden=32, intermediate=16, num_experts=16, top_k=2, ep_size=4, ep_mode="simulated",
                padding_ratio=0.5, padding_fill="repeat", mask=False, seed=7)
    base.update(kw)
    return Params(**base)


@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("ep_size", [2, 4, 8])
def test_rank_split_equals_imbalance_from_routing(mask, ep_size):
    p = sim_params(mask=mask, ep_size=ep_size, num_tokens=24)
    sim = simulated_batches(p, CPU, need_hidden=False)
    T = p.num_tokens
    assert sim.topk_ids.shape == (ep_size * T, p.top_k) and sim.is_padding.shape == (ep_size * T,)
    # rank-major: source rank s's rows are its own batch (its own padding at its tail)
    assert sim.is_padding.view(ep_size, T).sum(1).tolist() == [p.num_padding] * ep_size
    imb = imbalance(sim.topk_ids, sim.is_padding, p.num_experts, ep_size)
    works = [rank_work(sim, r) for r in range(ep_size)]
    assert [w.real_routes for w in works] == imb["per_rank_real"]
    assert [w.padding_routes for w in works] == imb["per_rank_padding"]
    assert [w.real_routes + w.padding_routes for w in works] == per_rank_loads(sim.topk_ids, p.num_experts,
                                                                                 ep_size).tolist()
    assert [w.real_rows for w in works] == imb["per_rank_tokens_real"]
    assert [w.padding_rows for w in works] == imb["per_rank_tokens_padding"]
    epr = p.num_experts // ep_size
    for w in works:  # local ids: this rank's experts only, each row has at least one
        assert ((w.local_ids >= -1) & (w.local_ids < epr)).all()
        assert (w.local_ids >= 0).any(dim=1).all()
        g = sim.topk_ids[w.rows].to(torch.int64)
        expect = torch.where((g >= w.rank * epr) & (g < (w.rank + 1) * epr), g - w.rank * epr, -1)
        assert torch.equal(w.local_ids.to(torch.int64), expect)
    if mask:
        assert sum(imb["per_rank_padding"]) == 0


def test_unmasked_repeat_padding_piles_up():
    """Each rank's padded rows are copies of one row: they all pick the same top_k experts, so that rank's whole
    padding lands on at most top_k experts (and ranks); masked, it lands nowhere."""
    p = sim_params(num_tokens=32, mask=False)
    sim = simulated_batches(p, CPU, need_hidden=False)
    T, K, R = p.num_tokens, p.top_k, p.ep_size
    for s in range(R):
        rows = slice(s * T, (s + 1) * T)
        pad_ids = sim.topk_ids[rows][sim.is_padding[rows]]
        assert (pad_ids == pad_ids[0]).all()  # identical routing
        counts = torch.bincount(pad_ids.flatten().long(), minlength=p.num_experts)
        assert sorted(counts[counts > 0].tolist()) == [p.num_padding] * K
    imb = imbalance(sim.topk_ids, sim.is_padding, p.num_experts, R)
    assert max(imb["per_rank_padding"]) >= p.num_padding  # one source's padding on one rank at least
    assert imb["expert"]["hottest_share"] > imb["real_only"]["expert"]["hottest_share"]
    assert imb["rank"]["slowest_excess"] > imb["real_only"]["rank"]["slowest_excess"]
    masked = simulated_batches(sim_params(num_tokens=32, mask=True), CPU, need_hidden=False)
    assert (masked.topk_ids[masked.is_padding] == -1).all()


@pytest.fixture(scope="module")
def cases():
    """The registered case, masked and unmasked, same seed (Triton under the interpreter on a CPU)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for mask in (True, False):
        case = registry.get("ep_sim.experts").build(sim_params(mask=mask), RunContext(device=dev))
        out[mask] = (case, case.check(), imbalance(case.routing.topk_ids, case.routing.is_padding,
                                                   case.routing.num_experts, case.routing.ep_size))
    return out


@pytest.mark.parametrize("mask", [True, False])
def test_registered_case_checks_and_reports(cases, mask):
    case, res, imb = cases[mask]
    assert res.ok, res.detail
    assert res.metrics["per_rank_loads.mismatches"] == 0 and res.metrics["out.rows_checked"] > 0
    info = case.info
    R = sim_params().ep_size
    assert info["simulated"] is True and info["ep_size"] == R and len(info["per_rank_us"]) == R
    assert info["per_rank_routes"] == {"real": imb["per_rank_real"], "padding": imb["per_rank_padding"]}
    assert info["per_rank_rows"] == {"real": imb["per_rank_tokens_real"], "padding": imb["per_rank_tokens_padding"]}
    assert info["slowest_rank"] == max(range(R), key=lambda r: info["per_rank_us"][r])
    assert info["slowest_us"] == max(info["per_rank_us"]) > 0
    assert info["slowest_excess_routes"] == imb["rank"]["slowest_excess"]
    assert info["hottest_expert_share"] == imb["expert"]["hottest_share"]
    assert case.routing.ep_size == R and case.flops > 0 and case.bytes_moved > 0
    case.run()


def test_masked_figures_equal_real_tokens_alone(cases):
    """Same seed: with the mask, the loads and every imbalance figure are those of the real tokens alone."""
    masked_case, _, masked = cases[True]
    unmasked_case, _, unmasked = cases[False]
    assert masked["per_rank_real"] == unmasked["per_rank_real"]
    assert masked["per_expert_real"] == unmasked["per_expert_real"]
    assert sum(masked["per_rank_padding"]) == 0 and sum(unmasked["per_rank_padding"]) > 0
    assert masked["rank"] == unmasked["real_only"]["rank"]
    assert masked["expert"] == unmasked["real_only"]["expert"]
    m, u = masked_case.info, unmasked_case.info
    assert m["per_rank_routes"]["real"] == u["per_rank_routes"]["real"]
    assert m["slowest_excess_routes"] == unmasked["real_only"]["rank"]["slowest_excess"]
    assert m["hottest_expert_share"] == unmasked["real_only"]["expert"]["hottest_share"]
    # unmasked: the padding makes the straggler and the hottest expert worse
    assert u["slowest_excess_routes"] > m["slowest_excess_routes"]
    assert u["hottest_expert_share"] > m["hottest_expert_share"]


def test_validate_and_targets():
    impl = registry.get("ep_sim.experts")
    assert set(impl.targets) == {"dispatch", "layer"} and not impl.multi_rank
    assert impl.validate(sim_params()) is None
    assert "simulated" in impl.validate(sim_params(ep_mode="real"))
    assert "num_local_experts" in impl.validate(sim_params(num_local_experts=3))


def test_runner_ep_scaling_records(tmp_path):
    from moebench.plots import make_plots
    from moebench.run.results import load_records
    from moebench.run.runner import run_sweep
    from moebench.run.sweep import sweep_from_dict

    sweep = sweep_from_dict({
        "name": "eps", "target": "layer", "impls": ["ep_sim.experts"],
        "fixed": {"num_tokens": 8, "hidden": 32, "intermediate": 16, "num_experts": 8, "top_k": 2,
                  "ep_mode": "simulated", "padding_ratio": 0.5, "padding_fill": "repeat", "mask": False},
        "axes": {"ep_size": [2, 4]},
        "timing": {"warmup": 0, "iters": 1}})
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu")
    make_plots(run_dir, tmp_path / "plots" / run_dir.name)
    recs = sorted(load_records(run_dir), key=lambda r: r["point"])
    assert code == 0 and [r["status"] for r in recs] == ["ok", "ok"]
    for r, R in zip(recs, (2, 4)):
        assert r["info"]["simulated"] is True and len(r["info"]["per_rank_us"]) == R
        assert r["imbalance"]["per_rank_padding"] == r["info"]["per_rank_routes"]["padding"]
    assert list((tmp_path / "plots" / run_dir.name).glob("ep_scaling*.png"))


def test_each_rank_is_timed_by_the_rank_timer_on_its_workload(monkeypatch):
    """One way to time a rank: ep_sim hands the serving trace's RankTimer each rank's rows and routes per local
    expert (a stood-in timer reads them back)."""
    from moebench.bench import ep_sim
    from moebench.bench.serving_trace.rank_timing import RankTimer

    monkeypatch.setattr(RankTimer, "__call__", lambda self, w: float(w.rows * 1000 + w.routes))
    p = sim_params()
    info = registry.get("ep_sim.experts").build(p, RunContext(device=CPU)).info
    rows = [a + b for a, b in zip(info["per_rank_rows"]["real"], info["per_rank_rows"]["padding"])]
    routes = [a + b for a, b in zip(info["per_rank_routes"]["real"], info["per_rank_routes"]["padding"])]
    assert info["per_rank_us"] == [float(r * 1000 + n) for r, n in zip(rows, routes)]
    sim = simulated_batches(p, CPU)
    work = rank_work(sim, 1)
    w = ep_sim.workload_of(work, sim.layout.local_experts)
    assert w.rows == work.rows.numel() and w.routes == work.real_routes + work.padding_routes
    assert w.problem(p.top_k) is None


def test_the_rank_timer_times_the_torch_reference_where_triton_cannot_run():
    from dataclasses import replace as params_replace

    from moebench.bench.serving_trace.rank_cost import Workload
    from moebench.bench.serving_trace.rank_timing import RankTimer
    from moebench.kernels.fused_experts import fused_experts_torch
    from moebench.params import Timing

    p = params_replace(sim_params(), expert_dtype="bf16")
    timer = RankTimer(p, CPU, Timing(mode="wall", warmup=0, iters=1, unroll=1), triton=False)
    call = timer.runner(Workload(5, (3, 0, 4, 1)))
    call.tensors["out"].fill_(float("nan"))
    call()
    t = call.tensors
    w13, w2 = timer.weights
    ref = fused_experts_torch(t["x"], w13, w2, t["topk_w"], t["ids"], compute_dtype=torch.bfloat16)
    assert torch.equal(t["out"], ref.to(t["out"].dtype)) and timer(Workload(5, (3, 0, 4, 1))) > 0
    with pytest.raises(ValueError, match="bf16 experts only"):
        RankTimer(params_replace(p, expert_dtype="fp8"), CPU, Timing(mode="wall"), triton=False)
