"""The EP step composed over arrays (ep_arrays) equals the per-step composition (ep_step) exactly, and the calls of
step_calls are step_padding's: over EP sizes, SP, DBO on and off, padding fills, idle DP ranks, steps above the
largest capture size, timed workloads beside the model's, and chunks smaller than the trace."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from moebench.bench.serving_trace.ep_arrays import COLUMNS, SourceTables, compose_arrays
from moebench.bench.serving_trace.ep_step import (EPStepLayout, StepMicroBatches, compose_priced,
                                                  padded_route_share, step_totals as totals)
from moebench.bench.serving_trace.launch import Launch
from moebench.bench.serving_trace.rank_cost import RankCostModel, RankTimes
from moebench.bench.serving_trace.routes import StepRoutes
from moebench.bench.serving_trace.step_calls import step_calls
from moebench.bench.serving_trace.wire import wire_time
from moebench.dispatch.wire_model import LinkModel, WireModel
from moebench.inputs.engine_padding import Engine, step_padding
from moebench.params import Params

CAPTURE = (1, 2, 4, 8, 16, 24)


def _real_tokens(rng: random.Random, steps: int, dp_size: int) -> list[list[int]]:
    """Random steps with idle DP ranks (0), counts above the largest capture size, and repeats of small counts."""
    out = []
    for _ in range(steps):
        out.append([rng.choice([0, rng.randint(1, 8), rng.randint(1, 30)]) for _ in range(dp_size)])
    return out


@pytest.mark.parametrize("dp_size,sp_size,dbo", [(1, 1, False), (2, 1, True), (2, 2, False), (3, 1, True),
                                                 (2, 3, True)])
def test_step_calls_are_step_paddings(dp_size, sp_size, dbo):
    rng = random.Random(dp_size * 10 + sp_size)
    engine = Engine(CAPTURE, dp_size=dp_size, sp_size=sp_size, dbo=dbo)
    real = _real_tokens(rng, 60, dp_size) + [[0] * dp_size, [1] * dp_size, [31] * dp_size]
    calls = step_calls(real, engine)
    for i, r in enumerate(real):
        want = step_padding(r, engine)
        assert calls.step(i) == want, r
        assert calls.padded_rows()[i] == want.padded_rows
        assert calls.total_rows()[i] == sum(c.rows for c in want.calls)


def _rank_times(launch_of, timed_from) -> RankTimes:
    """A cost model of two launches (unlike coefficients) and, read as timed, every third of some workloads."""
    model = RankCostModel(launch_of, coef={"small": [3.0, 1.5, 0.75, 0.125, 0.0625],
                                           "large": [5.0, 0.5, 2.25, 0.0, 0.3]}, fallback=[1.0] * 5)
    timed = {w: 0.1 + 0.37 * i for i, w in enumerate(timed_from[::3])}
    return RankTimes(timed, model)


def _wire() -> WireModel:
    return WireModel("test", LinkModel(300.0, 2.5), LinkModel(40.0, 11.0), ranks_per_node=2,
                     dispatch_overhead_us=7.0, combine_overhead_us=5.5)


@pytest.mark.parametrize("ep_size,dp_size,sp_size,dbo,fill", [
    (4, 2, 1, False, "zeros"), (4, 2, 1, True, "repeat"), (8, 2, 2, True, "random"), (2, 4, 1, False, "zeros"),
    (8, 1, 1, True, "zeros"), (4, 2, 2, False, "random")])
def test_the_array_composition_equals_the_per_step_one(ep_size, dp_size, sp_size, dbo, fill):
    p = replace(Params(), num_experts=16, top_k=4, hidden=64, intermediate=32, ep_size=ep_size, padding_fill=fill,
                bias=True, scoring="sigmoid")
    layout = EPStepLayout(0, ep_size, 16, sp_size=sp_size, dispatch_row_bytes=96, combine_row_bytes=128, dbo=dbo,
                          replicas=max(1, ep_size // (dp_size * sp_size)))
    engine = Engine(CAPTURE, dp_size=dp_size, sp_size=sp_size, dbo=dbo)
    real = _real_tokens(random.Random(ep_size * 100 + dp_size * 10 + sp_size), 40, dp_size) + [[0] * dp_size]
    paddings = [step_padding(r, engine) for r in real]
    routes = StepRoutes(p, torch.device("cpu"), layout)
    routes.prepare(paddings)
    wire = _wire()
    built = StepMicroBatches(layout, routes, wire_time(wire))
    workloads = [w for s in paddings for side in ("masked", "oblivious") for mb in built(s)[side] for w in mb.workloads
                 if w.rows]
    rank_times = _rank_times(lambda rows: Launch("small", 4) if rows < 12 else Launch("large", 8, True), workloads)
    per_step = compose_priced([built(s) for s in paddings], rank_times, dbo)

    tables = SourceTables(routes.slots, layout, dp_size, wire.ranks_per_node)
    cols = compose_arrays(step_calls(real, engine), tables, rank_times, wire, layout, chunk_steps=7)
    for side in ("masked", "oblivious"):
        for k in COLUMNS:
            want = [getattr(st[side], k) for st in per_step]
            assert cols.sides[side][k].tolist() == want, (side, k)
    counts = [1 + i % 5 for i in range(len(real))]
    assert cols.totals(counts, dbo) == totals(per_step, counts, dbo)
    if not dbo:  # nothing overlaps: the split's three parts are the difference, no float residue beside them
        assert cols.totals(counts, dbo)["tax"]["overlap_us"] == 0.0
    assert cols.padded_route_share(counts) == padded_route_share(per_step, counts)


def test_timed_workloads_are_read_as_timed_and_untimed_ones_refused_without_a_model():
    launch = lambda rows: Launch("small", 4)  # noqa: E731
    from moebench.bench.serving_trace.rank_cost import Workload

    a, b = Workload(3, (2, 1)), Workload(5, (4, 0))
    model = RankCostModel(launch, coef={"small": [1.0, 1.0, 1.0, 1.0, 1.0]}, fallback=[1.0] * 5)
    counts = np.asarray([[2, 1], [4, 0], [0, 0], [2, 1], [1, 2]])
    rows = np.asarray([3, 5, 0, 3, 3])
    got = RankTimes({a: 42.0, b: 7.0}, model).batch_array(counts, rows)
    assert got[:4].tolist() == [42.0, 7.0, 0.0, 42.0]
    assert got[4] == model.predict(Workload(3, (1, 2)))
    with pytest.raises(KeyError, match=r"\(3 rows, \[1, 2\]\) was not timed"):
        RankTimes({a: 42.0, b: 7.0}).batch_array(counts, rows)


def test_launches_are_looked_up_at_few_rows_and_equal_each_rows_own(monkeypatch):
    """launches_of asks launch_of at a few rows of each power-of-two bucket and gives every row its own launch,
    for a tuned table's buckets (constant per bucket, any order between buckets) and a rule's monotone thresholds,
    the kernels' real choice among them."""
    from moebench.bench.serving_trace.launch import launches_of
    from moebench.kernels.fused_experts import experts_choice

    table = {16: "c", 32: "a", 64: "c", 128: "b"}  # per bucket, not monotone across buckets

    def synthetic(rows: int) -> Launch:
        bucket = 1 << max(0, rows - 1).bit_length()
        if bucket in table:
            return Launch(table[bucket], 16)
        return Launch("bm16" if rows <= 300 else "bm32" if rows <= 700 else "bm64", 16)

    asked = []

    def counted(rows):
        asked.append(rows)
        return synthetic(rows)

    rows = sorted(set(random.Random(5).sample(range(1, 5000), 1500)) | {1, 2, 15, 16, 17, 300, 301, 700, 701})
    assert launches_of(counted, rows) == [synthetic(r) for r in rows]
    assert len(asked) < len(rows) // 5

    def rule(rows: int) -> Launch:  # the GPU rule, as the kernels pick it off the interpreter (no table for "cpu")
        cfg = experts_choice(rows, 8, 32, 7168, 2048, "cpu").config
        return Launch(cfg.short(), cfg.block_m, cfg.paired)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = list(range(1, 3000, 7))
    want = [rule(r) for r in rows]
    assert len({w.name for w in want}) >= 3  # the rule's thresholds fall inside the range
    assert launches_of(rule, rows) == want
