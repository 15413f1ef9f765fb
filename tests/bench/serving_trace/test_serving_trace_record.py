"""The serving_trace package's bookkeeping: the shape store owned by the run, the replay checks' recorded tolerance,
the typed record's round trip on a real CPU point, each step's micro-batches built once, the phase costs and the
note when the rank times and the wire figures come from different cards."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from moebench.bench.serving_trace import ep_step, replay
from moebench.bench.serving_trace.record import EPReplayRecord, EPStepRecord, ReplayRecord, TraceHeadline, card_note
from moebench.bench.serving_trace.trace_record import TraceRecord
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore, measure_shapes
from moebench.bench.serving_trace.wire import CPU_CARD, cards
from moebench.dispatch.wire_model import DEFAULT_WIRE_MODEL
from moebench.params import Params
from moebench.registry import RunContext, get

SMALL = dict(num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16)


class _CountingBench:
    """A ShapeBench stand-in that counts what it measures."""

    device = torch.device("cpu")
    last_spreads_us = {"masked": None, "oblivious": None}

    def __init__(self):
        self.routed, self.timed = [], []

    def shape_figures_many(self, shapes):
        self.routed += list(shapes)
        n = len(shapes)
        return {side: {"padding_gemm_rows": np.asarray([0 if side == "masked" else r - q for r, q in shapes]),
                       "rank_loads": np.zeros((n, 2), dtype=np.int64), "max_rows_per_rank": np.zeros(n, np.int64)}
                for side in ("masked", "oblivious")}

    def time_shape(self, rows, real):
        self.timed.append((rows, real))
        return {"masked": 10.0 + real, "oblivious": 10.0 + rows}


def test_the_shape_store_is_the_runs():
    """Within one run (one RunContext) a point at the same layer parameters, other capture sizes, reuses the shapes;
    a point at other layer parameters starts afresh; another run shares nothing."""
    p = replace(Params(), **SMALL, capture_sizes=[4, 8])
    run, other_run = RunContext(device=torch.device("cpu")), RunContext(device=torch.device("cpu"))
    bench = _CountingBench()
    shapes = [(4, 3), (3, 3), (8, 5)]
    _, table, measured = measure_shapes(p, bench, shapes, shapes, ShapeStore.of_run(run.run_store))
    assert measured == 3 and table[("oblivious", 8, 5)] == 18.0
    # the what-if axis (capture_sizes) is no layer parameter: the same run reuses every shape it measured
    _, _, measured = measure_shapes(replace(p, capture_sizes=[8]), bench, shapes[1:], shapes[1:],
                                    ShapeStore.of_run(run.run_store))
    # (the routing figures are gathers over the store's streams, read afresh by every point: 3 + 2 shapes)
    assert measured == 0 and len(bench.timed) == 3 and len(bench.routed) == 3 + 2
    # another run: nothing is shared
    _, _, measured = measure_shapes(p, bench, shapes, shapes, ShapeStore.of_run(other_run.run_store))
    assert measured == 3 and ShapeStore.of_run(other_run.run_store) is not ShapeStore.of_run(run.run_store)
    # other layer parameters in the same run: measured anew
    _, _, measured = measure_shapes(replace(p, top_k=1), bench, shapes, shapes, ShapeStore.of_run(run.run_store))
    assert measured == 3


def _ep_setup():
    from tests.bench.serving_trace.test_ep_step import _trace_setup, bytes_wire, rank_cost

    steps, lay, routes_of = _trace_setup()
    built = ep_step.StepMicroBatches(lay, routes_of, bytes_wire)
    return [built(s) for s in steps], lay, rank_cost


@pytest.mark.parametrize("off, within", [(0.02, True), (0.04, False)])
def test_the_ep_replay_verdict_is_its_recorded_tolerance(off, within):
    """A replay timing every rank `off` slower than the composition: within REPLAY_TOLERANCE (3%) or not, and the
    tolerance recorded beside the verdict."""
    step_mbs, lay, rank_cost = _ep_setup()
    got = replay.ep_replay(step_mbs, rank_cost, lambda w: rank_cost(w) * (1 + off), lay.dbo)
    assert got.tolerance == replay.REPLAY_TOLERANCE == 0.03
    assert got.within_tolerance == {"masked": within, "oblivious": within}
    assert got.worst("oblivious") == pytest.approx(off / (1 + off), rel=1e-2)


def test_the_verdict_follows_the_tolerance_it_records(monkeypatch):
    step_mbs, lay, rank_cost = _ep_setup()
    monkeypatch.setattr(replay, "REPLAY_TOLERANCE", 0.05)
    got = replay.ep_replay(step_mbs, rank_cost, lambda w: rank_cost(w) * 1.04, lay.dbo)
    assert got.tolerance == 0.05 and got.within_tolerance == {"masked": True, "oblivious": True}


def test_a_record_from_before_the_tolerance_reads_as_5pct():
    old = {"steps": 2, "composed": {}, "replayed": {}, "rel_diff": {"masked": {"experts_us": 0.04}},
           "within_5pct": {"masked": True, "oblivious": False}, "wall_s": 1.0}
    got = EPReplayRecord.from_info(old)
    assert got.tolerance == 0.05 and got.within_tolerance == {"masked": True, "oblivious": False}
    assert "oblivious NO" in got.verdict()


@pytest.fixture(scope="module")
def cpu_record(tmp_path_factory):
    """A real CPU point (the interpreter's kernels, timed): EP 2 over DP 2, DBO, both replays."""
    p = replace(Params(), **SMALL, ep_size=2, dp_size=2, dbo=True, trace=[3, 5, 3, 2], capture_sizes=[4, 8],
                trace_replay=2, ep_rank_timings=4)
    ctx = RunContext(device=torch.device("cpu"), run_dir=tmp_path_factory.mktemp("run"))
    return json.loads(json.dumps(get("serving_trace.layer").build(p, ctx).info))


def test_the_typed_record_reads_back_what_the_family_wrote(cpu_record):
    info = cpu_record
    rec = TraceRecord.from_info(info)
    assert TraceRecord.from_info(rec.to_info()) == rec
    # each part serialises exactly as the info holds it (the JSON keys and values the runs and tests read)
    assert rec.headline.to_info() == info["headline"] and isinstance(rec.headline, TraceHeadline)
    assert rec.ep_step.to_info() == info["ep_step"] and isinstance(rec.ep_step, EPStepRecord)
    assert rec.replay.to_info() == info["replay"] and isinstance(rec.replay, ReplayRecord)
    assert isinstance(rec.ep_step.replay, EPReplayRecord) and rec.ep_step.replay.tolerance == replay.REPLAY_TOLERANCE
    assert rec.replay.tolerance == replay.REPLAY_TOLERANCE and "within_5pct" not in json.dumps(info)
    assert rec.ep_step.rank_times == "model" and rec.ep_step.cost_model is not None
    assert rec.headline.ep_step.step_us == {s: info["ep_step"]["totals"][s]["step_us"] for s in ("masked", "oblivious")}


def test_the_record_states_what_each_phase_cost(cpu_record):
    from moebench.report.trace_tax import footer_lines

    phases = cpu_record["phase_wall_s"]
    assert set(phases) == {"routing", "shapes", "rank_workloads", "replay", "host_composition", "total"}
    assert all(v >= 0 for v in phases.values()) and phases["rank_workloads"] > 0 and phases["shapes"] > 0
    parts = sum(v for k, v in phases.items() if k != "total")
    assert parts <= phases["total"] + 1e-3
    text = "\n".join(footer_lines([{"target": "serving_trace", "status": "ok", "params": {}, "info": cpu_record}]))
    assert "phases: routing" in text and "rank workloads" in text


def test_the_wire_card_note(cpu_record):
    """The rank times' card and the wire figures' card are recorded; where they differ the record and the footer
    say so in one line, where they agree nothing is said."""
    from moebench.report.trace_tax import footer_lines

    ep = cpu_record["ep_step"]
    assert ep["rank_card"] == CPU_CARD and ep["wire_card"].startswith("2 x NVIDIA H200, dispatch run results/h200/")
    assert ep["card_note"] == card_note(CPU_CARD, "NVIDIA H200", DEFAULT_WIRE_MODEL.measured_on)
    text = "\n".join(footer_lines([{"target": "serving_trace", "status": "ok", "params": {}, "info": cpu_record}]))
    assert f"note: the rank times are from {CPU_CARD}, the wire figures from 2 x NVIDIA H200" in text
    assert card_note("NVIDIA H200", "NVIDIA H200", DEFAULT_WIRE_MODEL.measured_on) is None
    h100 = cards(torch.device("cpu"), replace(DEFAULT_WIRE_MODEL, gpu=CPU_CARD))
    assert h100["card_note"] is None and h100["rank_card"] == CPU_CARD
    same = {**cpu_record, "ep_step": {k: v for k, v in ep.items() if k != "card_note"}}
    text = "\n".join(footer_lines([{"target": "serving_trace", "status": "ok", "params": {}, "info": same}]))
    assert "note:" not in text


def test_the_dbo_overlap_is_stated_only_with_dbo(cpu_record):
    """Without DBO nothing overlaps: the tax split's overlap_us is the float residue of the step minus its parts,
    and no "DBO overlap 0.00 ms" is printed beside "DBO off"."""
    from moebench.report.trace_tax import ep_table, footer_lines

    def shown(dbo: bool, overlap_us: float) -> tuple[str, str]:
        ep = copy.deepcopy(cpu_record)
        ep["engine"]["dbo"] = dbo
        ep["headline"]["ep_step"]["tax_split_us"]["overlap_us"] = overlap_us
        rec = {"target": "serving_trace", "status": "ok", "params": {}, "info": ep}
        head, (row,) = ep_table([rec])
        return "\n".join(footer_lines([rec])), row[head.index("tax split ms: GEMM / straggler / wire / DBO overlap")]

    text, split = shown(False, 1e-9)
    assert "DBO off" in text and "DBO overlap" not in text and split.endswith(" / DBO off"), split
    text, split = shown(True, -1234.5)
    # the overlap rests on the rank times: the rank model's word may follow it
    assert "DBO on" in text and "DBO overlap -1.23 ms" in text and split.split(" / ")[-1].startswith("-1.23"), split


def test_each_steps_micro_batches_are_built_once(monkeypatch):
    """The replay and the largest step's record read one build of each step's micro-batches per side (a step read
    by both is built once)."""
    from moebench.bench.serving_trace import rank_timing
    from tests.bench.serving_trace.test_ep_step import rank_cost as stand_in

    monkeypatch.setattr(rank_timing.RankTimer, "__call__", lambda self, w: stand_in(w))
    monkeypatch.setattr(ShapeBench, "time_side", lambda self, sp, batch, side: 50.0 + sp.num_tokens)
    built = []
    real = ep_step.micro_batches

    def counted(step, layout, routes_of, side):
        built.append((id(step), side))
        return real(step, layout, routes_of, side)

    monkeypatch.setattr(ep_step, "micro_batches", counted)
    p = replace(Params(), **SMALL, ep_size=2, dp_size=2, trace=[3, 5, 3, 1], capture_sizes=[4, 8], trace_replay=3)
    info = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu"))).info
    assert info["trace"]["distinct_steps"] == 3 and info["ep_step"]["replay"]["steps"] == 3
    # the composition reads arrays (ep_arrays): steps are built one by one only for the replay (steps 0 and 1 of
    # the three distinct ones) and the largest step's record (step 1), each once
    assert len(built) == len(set(built)) == 2 * 2


def test_the_footer_states_each_models_held_out_error_against_its_tolerance():
    from moebench.bench.serving_trace.record import model_error_label

    ep = {"held_out": {"points": 170, "rms_rel": 0.0183, "max_rel": 0.06}, "tolerance": 0.03,
          "within_tolerance": True}
    assert model_error_label(ep) == "held-out error 1.8% RMS, within 3%"
    shapes = {"held_out": {"masked": {"points": 9, "rms_rel": 0.041, "max_rel": 0.1},
                           "oblivious": {"points": 9, "rms_rel": 0.012, "max_rel": 0.02}},
              "tolerance": 0.03, "within_tolerance": False}
    assert model_error_label(shapes) == "held-out error masked 4.1% RMS, oblivious 1.2% RMS, over 3%"
    assert model_error_label({"held_out": {"points": 0, "rms_rel": None}, "tolerance": 0.03}).startswith("its error unchecked")
