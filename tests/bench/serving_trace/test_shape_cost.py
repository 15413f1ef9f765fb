"""The single-rank view's shape plan: every shape timed while the budget allows, else a designed set and the
heaviest shapes timed, the rest read off a cost model per side and launch, with its held-out error; a call's
padding part is the timed difference or the model's, never a measurement minus a model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from moebench.bench.serving_trace.launch import Launch
from moebench.bench.serving_trace.shape_cost import (ShapeTable, design_shapes, plan_shape_times, shape_reads)
from moebench.bench.serving_trace.record import SIDES, ShapePlan
from moebench.bench.serving_trace.shape_streams import ShapeStreams
from moebench.params import Params


def _launch(rows: int) -> Launch:
    return Launch("bm16", 16) if rows < 24 else Launch("bm32", 32)


@pytest.fixture(scope="module")
def table():
    p = replace(Params(), num_experts=16, top_k=4, hidden=32, intermediate=16, ep_size=2, padding_fill="zeros",
                seed=11)
    streams = ShapeStreams(p, torch.device("cpu"), max_real=48, max_pad=48)
    shapes = sorted({(rows, real) for rows in range(1, 49) for real in range(0, rows + 1, 3)} |
                    {(n, n) for n in range(1, 49)})
    return ShapeTable(shapes, streams, _launch)


COEF = {"masked": [20.0, 0.5, 0.0, 0.25, 3.0, 2.0], "oblivious": [20.0, 0.5, 0.0, 0.3, 3.0, 2.0]}


def _linear(table):
    def time_shapes(batch):
        return {(side, *s): float(sum(c * f for c, f in zip(COEF[side], table.of(side, s))))
                for s in batch for side in SIDES}
    return time_shapes


def test_every_shape_is_timed_while_the_budget_allows(table):
    asked = []
    time_shapes = _linear(table)

    def counted(batch):
        asked.extend(batch)
        return time_shapes(batch)

    shapes = table.shapes[:40]
    time_of, info, timed = plan_shape_times(shapes, {s: 1 for s in shapes}, table, counted, 40, 0.03)
    assert info.shape_times == "exact" and sorted(asked) == sorted(shapes)
    assert all(time_of(side, *s) == timed[(side, *s)] for s in shapes for side in SIDES)


def test_beyond_the_budget_the_model_reads_the_rest_within_its_held_out_error(table):
    rng = random.Random(2)
    reads = {s: rng.randint(1, 50) for s in table.shapes}
    time_shapes = _linear(table)
    asked = []

    def counted(batch):
        asked.extend(batch)
        return time_shapes(batch)

    time_of, info, timed = plan_shape_times(table.shapes, reads, table, counted, 60, 0.03)
    assert info.shape_times == "model" and len(asked) == len(set(asked)) == info.shape_timings == 60
    assert info.design_timings >= 16  # both launches' minimum
    held = info.cost_model["held_out"]
    assert held["masked"]["points"] == held["oblivious"]["points"] == info.weighted_timings > 0
    assert held["oblivious"]["max_rel"] < 1e-6 and info.cost_model["within_tolerance"]
    truth = time_shapes(table.shapes)
    for s in table.shapes:
        for side in SIDES:
            assert time_of(side, *s) == pytest.approx(truth[(side, *s)], rel=1e-6)
    # the weighted rounds took the heaviest untimed shapes
    design = asked[:info.design_timings]
    rest = [s for s in table.shapes if s not in set(asked)]
    lightest_taken = min(reads[s] * sum(truth[(side, *s)] for side in SIDES) for s in asked if s not in design)
    assert all(reads[s] * sum(truth[(side, *s)] for side in SIDES) <= lightest_taken + 1e-9 for s in rest)


def test_a_padded_call_reads_its_padding_off_the_model_unless_both_shapes_are_timed(table):
    time_shapes = _linear(table)

    def off(batch):  # the (30, 12) measurement 10% off the cost every other shape follows
        return {k: v * (1.1 if k[1:] == (30, 12) else 1.0) for k, v in time_shapes(batch).items()}

    shapes = [s for s in table.shapes if s[0] <= 30]
    reads = {s: 1 for s in shapes} | {(30, 12): 10 ** 6}  # the heaviest: timed in the first round
    time_of, info, timed = plan_shape_times(shapes, reads, table, off, 40, 0.03)
    assert ("masked", 30, 12) in timed
    measured = timed[("masked", 30, 12)]
    if ("masked", 12, 12) in timed:
        assert time_of("masked", 30, 12) == measured
    else:  # the real tokens alone are the model's: so is the padding's part, not the measurement minus the model
        assert abs(time_of("masked", 30, 12) / measured - 1) > 0.05
    both = [(r, n) for (side, r, n) in timed if side == "masked" and n and r != n and ("masked", n, n) in timed]
    assert both and all(time_of("masked", r, n) == timed[("masked", r, n)] for r, n in both)
    # the lookup of many shapes at once (a long trace's 10^5 shapes) is time_of's, float for float
    for side in ("masked", "oblivious"):
        assert time_of.many(side, shapes).tolist() == [time_of(side, *s) for s in shapes]


def test_a_cost_the_model_cannot_follow_shows_in_its_held_out_error(table):
    def quadratic(batch):
        return {(side, *s): 10.0 + 0.05 * s[0] ** 2 + s[1] for s in batch for side in SIDES}

    _, info, _ = plan_shape_times(table.shapes, {s: 1 for s in table.shapes}, table, quadratic, 50, 0.03)
    assert not info.cost_model["within_tolerance"]
    assert info.cost_model["held_out"]["masked"]["rms_rel"] > 0.03


def test_the_design_reaches_each_launch_and_its_corners(table):
    got = design_shapes(table.shapes, table, 20, 20)
    small = [s for s in got if s[0] < 24]
    large = [s for s in got if s[0] >= 24]
    assert len(got) == 20 and small and large
    assert (1, 0) in got and (48, 48) in got


def test_shape_reads_count_a_padded_call_twice():
    assert shape_reads({(8, 3): 2, (3, 3): 1, (8, 0): 4}) == {(8, 3): 2, (3, 3): 3, (8, 0): 4}


def test_a_point_beyond_its_shape_budget_records_the_model(monkeypatch):
    from moebench.bench.serving_trace.shapes import ShapeBench
    from moebench.registry import RunContext, get

    monkeypatch.setattr(ShapeBench, "time_side", lambda self, sp, batch, side: 50.0 + 2.0 * sp.num_tokens
                        + (5.0 if side == "oblivious" else 0.0))
    p = replace(Params(), num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
                ep_size=1, trace=[3, 5, 3, 7, 2, 6, 1], capture_sizes=[4, 8], dp_size=2, trace_shape_timings=6)
    case = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu")))
    info = case.info
    assert info["distinct_shapes"] > 6 and info["shape_mode"] == "model"
    plan = ShapePlan.from_info(info["shape_plan"])
    assert plan.shape_timings == info["timed_shapes"] == 6 and plan.cost_model["per_launch"]
    assert sum(s["timed"] for s in info["shapes"]) == 6
    assert case.check().ok
