"""The EP step of a serving trace with stand-in timers: rank workloads and wire bytes exactly the routes' (masked:
real routes only), the step time as the slowest rank plus the wire, the DBO overlap formula, the tax split, the
replay check (which fails on a composition taking the mean rank), and the rank cost model."""

from __future__ import annotations

import random

import pytest
import torch

from moebench.bench.serving_trace import ep_measure, replay, routes as step_routes
from moebench.bench.serving_trace import ep_step as _ep_step
from moebench.bench.serving_trace.shape_streams import SLOT_SEED
from moebench.bench.serving_trace.ep_step import (EPStepLayout, SideStep, StepMicroBatches, call_routes,
                                                  compose_steps, dbo_step_us, micro_batches, side_step,
                                                  step_totals as totals, tax_split)
from moebench.bench.serving_trace.launch import Launch
from moebench.bench.serving_trace.plan import nnls
from moebench.bench.serving_trace.rank_cost import RankCostModel, Workload, design_sample, features, workload_ids
from moebench.bench.serving_trace.rank_plan import Contest, decisive_order, plan_rank_times
from moebench.bench.serving_trace.shapes import ShapeBench
from moebench.inputs.engine_padding import Engine, step_padding

ROW, BACK = 100, 10  # dispatch / combine bytes a row


def layout(ep_size=2, num_experts=4, sp_size=1, dbo=False, replicas=1):
    return EPStepLayout(0, ep_size, num_experts, sp_size=sp_size, dispatch_row_bytes=ROW, combine_row_bytes=BACK,
                        dbo=dbo, replicas=replicas)


def bytes_wire(phase, matrix):
    """A stand-in wire: 1 us per off-rank byte of the busiest sender."""
    rows = matrix.tolist()
    return float(max(sum(b for d, b in enumerate(row) if d != s) for s, row in enumerate(rows)))


def test_micro_batch_workloads_and_bytes_are_the_routes():
    # two DP ranks (sources on EP ranks 0 and 1), 4 experts over 2 EP ranks (experts 0-1 on rank 0, 2-3 on 1)
    step = step_padding([2, 1], Engine((2,), dp_size=2))  # calls (2, 2) on dp 0 and (2, 1) on dp 1
    ids = {0: torch.tensor([[0, 2], [1, 3]]),  # source 0: both rows reach both ranks
           1: torch.tensor([[1, 0], [-1, -1]])}  # source 1: its real row reaches rank 0 only; its padding masked

    def routes_of(rows, real, slot, side):
        return call_routes(ids[slot], 4, 2)

    (mb,) = micro_batches(step, layout(), routes_of, "masked")
    assert mb.workloads == [Workload(3, (2, 2)), Workload(2, (1, 1))]  # rank 0: 2 + 1 rows, rank 1: 2 rows
    assert mb.dispatch_bytes.tolist() == [[2 * ROW, 2 * ROW], [1 * ROW, 0]]
    # transposed: rows go back where they came from
    assert mb.combine_bytes.tolist() == [[2 * BACK, 1 * BACK], [2 * BACK, 0]]
    assert mb.off_rank_bytes("dispatch") == 3 * ROW and mb.off_rank_bytes("combine") == 3 * BACK


def test_masked_side_sends_real_routes_only():
    """A source's padded rows: masked, they route nowhere and send nothing; oblivious, every padded row (identical,
    all on the same experts) is a route and a row on the wire."""
    real = torch.tensor([[0, 2], [1, 3], [3, 0]])
    pad = torch.tensor([[2, 3]]).expand(5, 2)
    masked = call_routes(torch.cat([real, torch.full((5, 2), -1)]), 4, 2)
    oblivious = call_routes(torch.cat([real, pad]), 4, 2)
    assert masked.expert_routes == (2, 1, 1, 2) and masked.rank_rows == (3, 3)
    assert oblivious.expert_routes == (2, 1, 6, 7) and oblivious.rank_rows == (3, 8)
    step = step_padding([3], Engine((8,), dp_size=1))
    mbs = {side: micro_batches(step, layout(), lambda r, q, s, side=side: {"masked": masked,
                                                                           "oblivious": oblivious}[side], side)[0]
           for side in ("masked", "oblivious")}
    # source 0 is rank 0: only rows sent to rank 1 cross the wire
    assert mbs["masked"].off_rank_bytes("dispatch") == 3 * ROW
    assert mbs["oblivious"].off_rank_bytes("dispatch") == 8 * ROW


def test_the_step_waits_for_its_slowest_rank():
    mb = _ep_step.MicroBatch.of_workloads([Workload(1, (1, 0)), Workload(4, (4, 4)), Workload(2, (2, 0))],
                             [[0] * 3] * 3, [[0] * 3] * 3)
    s = side_step([mb.priced(lambda phase, m: 5.0)], lambda w: 10.0 * w.routes, dbo=False)
    assert s.experts_us == 80.0 and s.slowest_rank == 1 and s.rank_us == [10.0, 80.0, 20.0]
    assert s.mean_rank_us == pytest.approx((10 + 80 + 20) / 3)
    assert s.step_us == 5.0 + 80.0 + 5.0


@pytest.mark.parametrize("parts, want", [
    ([(3, 10, 2), (4, 8, 1)], 3 + max(10, 4) + max(2, 8) + 1),  # compute hides the wire
    ([(20, 5, 15), (25, 6, 10)], 20 + 25 + 15 + 10),  # the wire dominates: compute hidden
    ([(1, 2, 3)], 6),
])
def test_dbo_overlap_formula(parts, want):
    assert dbo_step_us(parts) == want
    assert dbo_step_us(parts) <= sum(map(sum, parts))


def test_tax_split_adds_up():
    m = SideStep(step_us=100, experts_us=60, mean_rank_us=50, dispatch_us=20, combine_us=20)
    o = SideStep(step_us=190, experts_us=120, mean_rank_us=70, dispatch_us=30, combine_us=25)
    split = tax_split(m, o)
    assert split == {"gemm_us": 20, "straggler_us": 40, "wire_us": 15, "overlap_us": 15, "total_us": 90}
    assert tax_split(m, m)["total_us"] == 0 and tax_split(m, m)["straggler_us"] == 0


def _trace_setup(dbo=False):
    """Two DP ranks x 2 SP ranks on 4 EP ranks, 8 experts; oblivious padding piles onto experts 6 and 7."""
    engine = Engine((4, 8), dp_size=2, sp_size=2, dbo=dbo)
    steps = [step_padding(r, engine) for r in ([3, 1], [7, 2], [1, 1])]
    lay = layout(4, 8, 2, dbo)
    rng = random.Random(0)
    cache = {}

    def routes_of(rows, real, slot, side):
        if (rows, real, slot) not in cache:
            ids = torch.tensor([rng.sample(range(8), 2) for _ in range(real)] or torch.empty(0, 2).tolist(),
                               dtype=torch.int64).reshape(real, 2)
            pad = torch.tensor([[6, 7]]).expand(rows - real, 2)
            cache[(rows, real, slot)] = {"masked": call_routes(torch.cat([ids, torch.full_like(pad, -1)]), 8, 4),
                                         "oblivious": call_routes(torch.cat([ids, pad]), 8, 4)}
        return cache[(rows, real, slot)][side]
    return steps, lay, routes_of


BM64 = Launch("bm64", 64)


def rank_cost(w):
    return 0.0 if not w.rows else 5.0 + 2.0 * w.routes + 1.5 * features(w, BM64)[2]


def test_replay_check_passes_the_composition_and_fails_a_mean_rank_one(monkeypatch):
    steps, lay, routes_of = _trace_setup()
    for s in steps:
        for side in ("masked", "oblivious"):
            for mb in micro_batches(s, lay, routes_of, side):
                pass  # fill the routes cache in a fixed order
    built = StepMicroBatches(lay, routes_of, bytes_wire)
    step_mbs = [built(s) for s in steps]
    good = replay.ep_replay(step_mbs, rank_cost, rank_cost, lay.dbo)
    assert good.within_tolerance == {"masked": True, "oblivious": True}
    assert good.tolerance == replay.REPLAY_TOLERANCE
    assert good.rel_diff["oblivious"]["experts_us"] == 0.0

    real_side_step = _ep_step.side_step

    def mean_rank_step(mbs, rank_time, dbo):
        s = real_side_step(mbs, rank_time, dbo)
        s.step_us -= s.experts_us - s.mean_rank_us  # the mean rank's time in place of the slowest's
        s.experts_us = s.mean_rank_us
        return s

    monkeypatch.setattr(_ep_step, "side_step", mean_rank_step)
    bad = replay.ep_replay(step_mbs, rank_cost, rank_cost, lay.dbo)
    assert bad.within_tolerance["oblivious"] is False  # the padding's straggler is what the mean misses


def test_composition_totals_weight_distinct_steps_and_split_the_tax():
    steps, lay, routes_of = _trace_setup(dbo=True)
    per_step = compose_steps(steps, lay, routes_of, rank_cost, bytes_wire)
    tot = totals(per_step, [3, 1, 2])
    for side in ("masked", "oblivious"):
        assert tot["sums"][side]["step_us"] == pytest.approx(
            sum(n * st[side].step_us for st, n in zip(per_step, [3, 1, 2])))
    tax = tot["tax"]
    assert tax["gemm_us"] + tax["straggler_us"] + tax["wire_us"] + tax["overlap_us"] == pytest.approx(
        tax["total_us"])
    assert tax["straggler_us"] > 0 and tax["wire_us"] > 0 and tax["gemm_us"] > 0
    assert tax["overlap_us"] <= 0  # DBO hides part of what padding adds
    assert _ep_step.padded_route_share(per_step, [3, 1, 2]) > 0.5  # the pile of padding is on the straggler


# ---------------------------------------------------------------------------------------------------------------
# Rank workloads and the cost model
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_workload_ids_reproduce_the_counts_exactly(seed):
    rng = random.Random(seed)
    top_k, experts = rng.choice([1, 2, 8]), rng.randint(1, 12)
    rows = rng.randint(1, 40)
    ids = torch.tensor([rng.sample(range(experts + 3), min(top_k, experts + 3)) for _ in range(rows)])
    local = torch.where(ids < experts, ids, torch.full_like(ids, -1))
    local = local[(local >= 0).any(dim=1)]
    w = Workload(local.shape[0], tuple(torch.bincount(local[local >= 0], minlength=experts).tolist()))
    got = workload_ids(w, local.shape[1])
    assert got.dtype == torch.int32 and got.shape == local.shape
    assert torch.bincount(got[got >= 0].long(), minlength=experts).tolist() == list(w.counts)
    assert bool(((got >= 0).sum(dim=1) >= 1).all())  # every received row has a route
    for row in got.tolist():
        kept = [e for e in row if e >= 0]
        assert len(kept) == len(set(kept))  # an expert at most once a row


def test_impossible_workloads_are_refused():
    for w in (Workload(2, (3, 0)), Workload(3, (1, 1)), Workload(1, (1, 1, 1)), Workload(0, (1,))):
        with pytest.raises(ValueError):
            workload_ids(w, 2)
    assert workload_ids(Workload(0, (0, 0)), 2).shape == (0, 2)


def _two_launches(rows):
    """A stand-in for the kernel's choice: 16-row blocks under 64 rows, paired 64-row blocks from there."""
    return Launch("bm16", 16) if rows < 64 else Launch("bm64x2", 64, paired=True)


def test_a_launch_counts_its_own_row_tiles():
    assert Launch("bm16", 16).row_tiles([1, 16, 17, 0]) == 1 + 1 + 2
    # paired: full tiles of two 64-row blocks, an odd last block on its own tile
    assert Launch("p", 64, paired=True).row_tiles([64, 65, 129, 257]) == 1 + 1 + 2 + 3


def test_nnls_and_the_cost_model_recover_a_cost_per_launch():
    """Each launch config its own coefficients over its own row tiles: recovered exactly; one fit across both
    launches (what a fixed tile size amounts to) cannot."""
    coef = {"bm16": [7.0, 0.0, 1.5, 0.25, 0.5], "bm64x2": [20.0, 3.0, 6.0, 0.1, 0.0]}
    assert nnls([[1, 0], [0, 1], [1, 1]], [1, -1, 0]) == pytest.approx([1 / 2, 0], abs=1e-9)
    rng = random.Random(3)
    loads = [Workload(r, tuple(rng.choice((0, rng.randint(1, r))) for _ in range(4))) for r in range(1, 400, 2)]
    loads = [w for w in loads if w.problem(8) is None and w.rows]  # experts touched 1..4: no feature constant

    def truth(w):
        launch = _two_launches(w.rows)
        return sum(c * f for c, f in zip(coef[launch.name], features(w, launch)))

    model = RankCostModel.fit(_two_launches, {w: truth(w) for w in loads})
    for name in coef:
        assert model.coef[name] == pytest.approx(coef[name], abs=1e-6)
        assert model.record()["per_launch"][name]["cross_validated"]["max_rel"] < 1e-9
    assert model.predict(Workload(0, (0, 0, 0, 0))) == 0.0
    one = RankCostModel.fit(lambda rows: BM64, {w: truth(w) for w in loads})
    assert one.record()["per_launch"]["bm64"]["cross_validated"]["rms_rel"] > 0.01


def test_the_design_spans_each_launch_within_the_limit():
    loads = [Workload(r, (r, r // 2)) for r in range(1, 200)]
    sample = design_sample(loads, 12, _two_launches)
    small = [w for w in sample if w.rows < 64]
    large = [w for w in sample if w.rows >= 64]
    assert len(small) >= 8 and len(large) >= 8 and len(set(sample)) == len(sample)
    for group in ([w for w in loads if w.rows < 64], [w for w in loads if w.rows >= 64]):
        assert group[0] in sample and group[-1] in sample  # the corners
    limited = design_sample(loads, 12, _two_launches, limit=4)
    assert len(limited) == 4 and {w.rows < 64 for w in limited} == {True, False}  # both launches reached
    assert design_sample(loads[:5], 12, _two_launches) == loads[:5]


def test_the_decisive_workloads_are_the_candidates_for_the_slowest_rank():
    a, b, c, d = (Workload(n, (n,)) for n in (100, 99, 40, 10))
    contests = [Contest(5, (a, b, c)), Contest(1, (c, d))]
    order = decisive_order(contests, lambda w: float(w.rows), 0.01, {})
    assert order == [a, b, c]  # a and b within 2% of the slowest; c the slowest of the second contest
    assert decisive_order(contests, lambda w: float(w.rows), 0.01, {a: 100.0, b: 99.0, c: 40.0}) == []


def test_rank_times_time_each_workload_or_model_them_and_time_the_slowest():
    loads = [Workload(round(10 * 1.05 ** i), (round(10 * 1.05 ** i), 1)) for i in range(60)]  # 5% apart: the
    # slowest of each contest stands out of the model's 2 x 1% error
    contests = [Contest(1 + i % 3, tuple(loads[i:i + 4])) for i in range(0, 56, 2)]
    calls = []

    def timer(w):
        calls.append(w)
        return rank_cost(w)

    seen = {w for c in contests for w in c.workloads}
    lookup, rec = plan_rank_times(contests, timer, 64, lambda rows: BM64, 0.03)
    assert rec.rank_times == "timed" and set(calls) == seen and len(calls) == len(seen)
    calls.clear()
    lookup, rec = plan_rank_times(contests, timer, 20, lambda rows: BM64, 0.03)
    assert rec.rank_times == "model" and len(calls) == len(set(calls)) == rec.rank_timings == 20
    assert rec.design_timings >= 8 and rec.decisive_timings == 20 - rec.design_timings
    # the model is exact on a linear cost: held out, its error is 0 and within the tolerance
    assert rec.cost_model["held_out"]["points"] == rec.decisive_timings
    assert rec.cost_model["held_out"]["max_rel"] < 1e-6 and rec.cost_model["within_tolerance"]
    for w in seen:
        assert lookup(w) == pytest.approx(rank_cost(w), rel=1e-6)
    # the timed ones are what the contests' slowest ranks are
    slowest = {max(c.workloads, key=rank_cost) for c in contests}
    assert set(calls[rec.design_timings:]) <= slowest


def test_known_workloads_are_read_never_timed_and_left_out_of_the_budget():
    loads = [Workload(round(10 * 1.05 ** i), (round(10 * 1.05 ** i), 1)) for i in range(60)]
    contests = [Contest(1 + i % 3, tuple(loads[i:i + 4])) for i in range(0, 56, 2)]
    seen = {w for c in contests for w in c.workloads}
    known = {w: 7.0 for w in loads[:10]}  # another point's timings: read as they are, even where the cost differs
    calls = []

    def timer(w):
        calls.append(w)
        return rank_cost(w)

    lookup, rec = plan_rank_times(contests, timer, 64, lambda rows: BM64, 0.03, known=known)
    assert rec.rank_times == "timed" and set(calls) == seen - set(known) and rec.rank_timings == len(calls)
    assert rec.reused_timings == len(seen & set(known)) and all(lookup(w) == 7.0 for w in known)
    calls.clear()
    lookup, rec = plan_rank_times(contests, timer, 20, lambda rows: BM64, 0.03, known=known)
    assert rec.rank_times == "model" and rec.rank_timings == len(calls) == 20 and not set(calls) & set(known)
    assert rec.reused_timings == len(known) and lookup(loads[0]) == 7.0


def test_the_decisive_rounds_stop_at_the_seconds_given(monkeypatch):
    import moebench.bench.serving_trace.rank_plan as rank_plan_module
    from moebench.bench.serving_trace.plan import run_plan

    loads = [Workload(round(10 * 1.05 ** i), (round(10 * 1.05 ** i), 1)) for i in range(60)]
    contests = [Contest(1 + i % 3, tuple(loads[i:i + 4])) for i in range(0, 56, 2)]
    now = [0.0]

    def timer(w):  # each timing a second of a stood-in clock
        now[0] += 1.0
        return rank_cost(w)

    monkeypatch.setattr(rank_plan_module, "run_plan", lambda *a, **kw: run_plan(*a, **kw, clock=lambda: now[0]))
    _, free = plan_rank_times(contests, timer, 40, lambda rows: BM64, 0.03)
    now[0] = 0.0
    _, capped = plan_rank_times(contests, timer, 40, lambda rows: BM64, 0.03, seconds=1.0)
    assert free.stopped_by in ("budget", "candidates") and free.decisive_rounds >= 1
    # the design is timed whole (more than the second), then no decisive round starts
    assert capped.stopped_by == "seconds" and capped.decisive_timings == 0 and capped.design_timings >= 8


def test_a_cost_the_model_cannot_follow_shows_in_its_held_out_error():
    loads = [Workload(r, (r, 1)) for r in range(1, 200)]
    contests = [Contest(1, tuple(loads[i:i + 4])) for i in range(0, 196, 4)]
    lookup, rec = plan_rank_times(contests, lambda w: 10.0 + 1e-3 * w.routes ** 2, 40, lambda rows: BM64, 0.03)
    held = rec.cost_model["held_out"]
    assert held["points"] > 0 and held["rms_rel"] > 0.03 and not rec.cost_model["within_tolerance"]
    # the workloads it timed are read as timed all the same
    assert rec.decided_by_timing_share is not None


def test_an_ep_group_larger_than_dp_x_sp_holds_copies_of_it():
    """EP 4 over DP 1 x SP 2: two groups of the trace's token counts, each source its own routing and rank."""
    step = step_padding([3], Engine((4,), dp_size=1, sp_size=2))  # SP chunks (2, 2) and (2, 1)
    lay = layout(4, 8, 2, replicas=2)
    asked = []

    def routes_of(rows, real, slot, side):
        asked.append(slot)
        ids = torch.tensor([[slot * 2, slot * 2 + 1]] * real + [[-1, -1]] * (rows - real))
        return call_routes(ids, 8, 4)

    (mb,) = micro_batches(step, lay, routes_of, "masked")
    assert sorted(asked) == [0, 1, 2, 3]
    # source slot s sends its real rows to its own rank (experts 2s, 2s+1 live on rank s): nothing crosses the wire
    assert [w.rows for w in mb.workloads] == [2, 1, 2, 1] and mb.off_rank_bytes("dispatch") == 0
    assert _ep_step.placement_problem(6, 2, 2) and _ep_step.placement_problem(8, 2, 2) is None


# ---------------------------------------------------------------------------------------------------------------
# The EP step in a serving_trace point (the rank timer stood in: the interpreter's timings are noise)
# ---------------------------------------------------------------------------------------------------------------

def test_serving_trace_records_the_ep_step(monkeypatch):
    from dataclasses import replace

    from moebench.bench.serving_trace import rank_timing as _rank_timing
    from moebench.params import Params
    from moebench.registry import RunContext, get

    timed = []

    def stand_in(self, w):
        timed.append(w)
        return rank_cost(w)

    monkeypatch.setattr(_rank_timing.RankTimer, "__call__", stand_in)
    # the single-rank layer's timings stood in as well (tests/bench/serving_trace/test_serving_trace.py times them)
    monkeypatch.setattr(ShapeBench, "time_side", lambda self, sp, batch, side: 50.0 + sp.num_tokens)
    p = replace(Params(), num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
                ep_size=4, dp_size=2, sp_size=1, padding_fill="zeros", trace=[3, 5, 3, 1], capture_sizes=[4, 8],
                trace_replay=2, ep_rank_timings=200)
    impl = get("serving_trace.layer")
    assert impl.validate(p) is None
    run = RunContext(device=torch.device("cpu"))
    info = impl.build(p, run).info
    ep, head = info["ep_step"], info["headline"]["ep_step"]
    assert ep["rank_times"] == "timed" and ep["distinct_workloads"] == ep["rank_timings"] > 0
    assert ep["wire"]["kind"] == "model" and ep["payload"] == {"dtype": "bf16", "dispatch_row_bytes": 64 * 2 + 16,
                                                               "combine_row_bytes": 128}
    assert "2 DP groups" in ep["placement"]
    assert ep["replay"]["within_tolerance"] == {"masked": True, "oblivious": True}
    assert ep["replay"]["tolerance"] == replay.REPLAY_TOLERANCE
    assert head["step_us"]["oblivious"] > head["step_us"]["masked"] > 0
    split = head["tax_split_us"]
    assert split["gemm_us"] + split["straggler_us"] + split["wire_us"] + split["overlap_us"] == pytest.approx(
        split["total_us"], abs=1e-2)
    assert split["straggler_us"] > 0  # identical zero rows pile onto the same experts
    # per step, and the distinct steps weighted: [3, 5, 3, 1] holds 3 distinct steps, (3, 3) twice
    assert info["trace"]["distinct_steps"] == 3 and len(info["trace_steps"]) == 4
    assert info["trace_steps"][0]["ep_step_us"] == info["trace_steps"][2]["ep_step_us"]
    total = sum(s["ep_step_us"]["oblivious"] for s in info["trace_steps"])
    assert total == pytest.approx(head["step_us"]["oblivious"], rel=1e-4)
    largest = ep["largest_step"]
    assert largest["rows"] == max(s["rows"] for s in info["trace_steps"])
    assert len(largest["oblivious"]["rank_us"]) == 4
    assert largest["oblivious"]["slowest_us"] == max(largest["oblivious"]["rank_us"])
    # the same run at the same layer point: every workload read from the run's store, none timed again, so the
    # EP step is the same to the bit (what keeps the masked step equal across a run's capture lists)
    again = impl.build(replace(p, ep_rank_timings=3), run).info
    assert again["shapes_measured"] == 0
    assert again["ep_step"]["rank_timings"] == 0
    assert again["ep_step"]["rank_plan"]["reused_timings"] == ep["distinct_workloads"]
    assert again["ep_step"]["totals"] == ep["totals"]
    from moebench.bench.serving_trace.record import EPStepRecord
    label = EPStepRecord.from_info(again["ep_step"]).rank_times_label()
    assert f"{ep['distinct_workloads']} read from the run's earlier points" in label, label
    # the model path: fewer timings allowed than distinct workloads (a new run: nothing known)
    info = impl.build(replace(p, ep_rank_timings=3), RunContext(device=torch.device("cpu"))).info
    assert info["ep_step"]["rank_times"] == "model" and info["ep_step"]["rank_timings"] == 3
    assert info["ep_step"]["rank_plan"]["design_timings"] <= info["ep_step"]["rank_timings"]
    assert info["ep_step"]["rank_plan"]["stopped_by"] == "budget"


@pytest.mark.parametrize("fill", ["zeros", "repeat", "random"])
def test_a_calls_routes_are_those_of_its_own_batch(fill):
    """StepRoutes counts a call off its slot's routed batches: the same figures as routing the call's own rows (the
    slot's first `real` rows, then its padding as padding_fill makes it), on both sides; sources differ, and with
    zero-filled padding every source's padded rows route alike."""
    from dataclasses import replace

    from moebench.bench.serving_trace.shape_streams import shape_params
    from moebench.inputs import make_batch, route
    from moebench.params import Params

    p = replace(Params(), num_experts=16, top_k=4, hidden=64, intermediate=32, ep_size=4, padding_fill=fill,
                bias=True, scoring="sigmoid")
    lay = layout(4, 16, 1)
    routes = step_routes.StepRoutes(p, torch.device("cpu"), lay)
    routes.prepare([step_padding([5, 9], Engine((12,), dp_size=2))])
    sp = shape_params(p, 12, 9)
    # slot 1's streams: its real tokens' and its padding's, each a power of two at least its most real tokens (9)
    logits = make_batch(shape_params(p, 16, 16), "cpu", need_hidden=False,
                        seed_offset=SLOT_SEED * 2).logits[:12].clone()
    if fill == "zeros":
        logits[9:] = 0
    elif fill == "repeat":
        logits[9:] = logits[0]
    else:
        logits[9:] = make_batch(shape_params(p, 16, 0), "cpu", need_hidden=False,
                                seed_offset=SLOT_SEED * 2 + 1).logits[:3]
    batch = make_batch(sp, "cpu", need_hidden=False)
    batch = replace(batch, logits=logits, bias=routes.bias)
    for side in ("masked", "oblivious"):
        _, ids = route(sp, batch, use_mask=side == "masked")
        assert routes(12, 9, 1, side) == call_routes(ids, 16, 4), side
    assert routes(12, 5, 0, "masked") != routes(12, 5, 1, "masked")  # a shape both slots have: their own rows
    if fill == "zeros":  # the padding alone: identical on every source
        def pad_only(slot):
            o, m = routes(12, 5, slot, "oblivious"), routes(12, 5, slot, "masked")
            return [a - b for a, b in zip(o.expert_routes, m.expert_routes)]
        assert pad_only(0) == pad_only(1) and max(pad_only(0)) == 7


def test_a_long_trace_keeps_distinct_steps_and_writes_every_step_to_the_step_file(monkeypatch, tmp_path):
    """Past STEP_RECORDS_MAX steps the record holds one entry per distinct step with its count, and the run's step
    file every step's figures (read back through the per-step index, equal to the distinct step's)."""
    from dataclasses import replace

    from moebench.bench.serving_trace import rank_timing as _rank_timing, steps
    from moebench.params import Params
    from moebench.registry import RunContext, get
    from moebench.traces.step_file import read_step_columns

    monkeypatch.setattr(_rank_timing.RankTimer, "__call__", lambda self, w: rank_cost(w))
    monkeypatch.setattr(ShapeBench, "time_side", lambda self, sp, batch, side: 50.0 + sp.num_tokens)
    monkeypatch.setattr(steps, "STEP_RECORDS_MAX", 5)
    monkeypatch.setattr(ep_measure, "COLLECT_STEPS", 2)  # workloads read from 2 of the 3 distinct steps: a model
    trace = tmp_path / "t.csv"
    trace.write_text("dp0,dp1\n" + "3,1\n5,2\n" * 6 + "1,1\n")
    p = replace(Params(), num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
                ep_size=2, dp_size=2, trace_file=str(trace), capture_sizes=[4, 8], ep_rank_timings=50)
    info = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu"), run_dir=tmp_path)).info
    assert info["trace_steps"] is None and info["trace"]["steps"] == 13 and info["trace"]["distinct_steps"] == 3
    assert [d["count"] for d in info["distinct_step_records"]] == [6, 6, 1]
    assert info["ep_step"]["workloads_read_from_steps"] == 2 and info["ep_step"]["rank_times"] == "model"
    cols, meta = read_step_columns(tmp_path, info["step_file"])
    assert cols["real_dp0"].tolist() == [3, 5] * 6 + [1] and "ep_step_us_<side>" in meta["columns"]
    for side in ("masked", "oblivious"):
        per_step = cols[f"ep_step_us_{side}"]
        assert per_step.shape == (13,)
        assert float(per_step.sum()) == pytest.approx(info["headline"]["ep_step"]["step_us"][side], rel=1e-4)
        assert float(cols[f"layer_us_{side}"].sum()) == pytest.approx(info["headline"]["layer_us"][side], rel=1e-4)


@pytest.mark.gpu
def test_on_the_gpu_the_ep_step_times_its_plan_and_states_its_verdicts():
    """On the GPU, a point past its rank-timing budget: a designed set and the decisive workloads timed on the card
    (the rank timer's settled samples), the model's held-out error and the replay's deviations recorded, and each
    verdict what its own figures and tolerance say. No timing agreement is asserted here (a shared GPU's timings
    move with the other tests on it): what a replay shows is in the committed runs (docs/benchmarks.md)."""
    from dataclasses import replace

    from moebench.params import Params
    from moebench.registry import RunContext, get

    p = replace(Params(), model="deepseek-v3", num_experts=256, top_k=8, num_expert_group=8, topk_group=4,
                scoring="sigmoid", bias=True, ep_size=8, dp_size=4, sp_size=2, padding_fill="zeros",
                trace_distribution="prefill_heavy", trace_steps=12, trace_max_tokens=2048, trace_replay=3,
                ep_rank_timings=48, trace_shape_timings=24, capture_sizes="default")
    info = get("serving_trace.layer").build(p, RunContext(device=torch.device("cuda"))).info
    ep = info["ep_step"]
    assert ep["rank_times"] == "model" and ep["rank_timings"] == 48
    assert ep["rank_card"] == torch.cuda.get_device_name()
    plan, model = ep["rank_plan"], ep["cost_model"]
    assert plan["design_timings"] + plan["decisive_timings"] == 48 and plan["timer"]["timings"] >= 48
    held = model["held_out"]
    assert held["points"] == plan["decisive_timings"] > 0 and held["rms_rel"] >= 0
    assert model["within_tolerance"] == (held["rms_rel"] <= model["tolerance"])
    checked = ep["replay"]
    assert checked["tolerance"] == replay.REPLAY_TOLERANCE
    for side in ("masked", "oblivious"):
        rel = checked["rel_diff"][side]
        assert all(v is not None and v >= 0 for v in rel.values())
        assert checked["within_tolerance"][side] == all(v <= checked["tolerance"] for v in rel.values())
    shapes = info["shape_plan"]
    assert shapes["shape_times"] == "model" and shapes["shape_timings"] == 24


def test_a_capture_list_leaves_the_real_tokens_routing_where_it_was():
    """The what-if over capture lists compares like with like: the same real tokens route the same way whatever
    the padding around them (the slot's real stream is sized by its real tokens, the bias drawn apart), and slot 0
    is the single-rank view's stream."""
    from dataclasses import replace

    from moebench.bench.serving_trace.shape_streams import ShapeStreams
    from moebench.params import Params

    p = replace(Params(), num_experts=16, top_k=4, hidden=64, intermediate=32, ep_size=4, padding_fill="zeros",
                bias=True, scoring="sigmoid")
    lay = layout(4, 16, 1)
    got = {}
    for capture in ((6, 12), (5, 9, 16), (64,)):
        routes = step_routes.StepRoutes(p, torch.device("cpu"), lay)
        routes.prepare([step_padding([5, 9], Engine(capture, dp_size=2))])
        got[capture] = [routes(9, 9, 1, "masked"), routes(5, 5, 0, "masked")]
    assert len({tuple(v) for v in got.values()}) == 1
    streams = ShapeStreams(p, torch.device("cpu"), 16, 16)
    assert routes(5, 5, 0, "masked").rank_rows == tuple(streams.counts("rank_rows", [5], [5], "masked")[0].tolist())
