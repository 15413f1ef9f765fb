"""The serving_trace target: the padding tax of a serving configuration over a serving trace.

`serving_trace.layer` takes an engine configuration and a trace, and gives the MoE layer's GPU time over the
trace with the padding masked and with it routed (both sides in every record), split into real and padded rows.
  engine  the layer's parameters (a `model:` preset or the shape keys; expert_dtype; ep_size, this rank owning
          num_experts / ep_size experts as in the layer target), capture_sizes (a name of
          moebench.traces.capture_lists or a list), dp_size, sp_size (the SP / TP ranks), dbo, padding_fill
  trace   trace_file (a CSV: moebench.traces.csv_trace), else trace (one list of token counts for every DP
          rank), else trace_steps counts per DP rank drawn from trace_distribution (chat, mixed, prefill_heavy,
          uniform, decode_prefill, lognormal: moebench.traces.distributions) up to trace_max_tokens
Every step goes through the producers (moebench.inputs.engine_padding: capture size, DP max, DBO halves, SP
divisibility), giving its layer calls (rows, real). Every distinct shape's routing figures are exact, prefix sums of
two routed streams (shape_streams.py, no batch per shape). The timings (both sides' layers built once and timed)
follow trace_real_points: 0 times every distinct shape while they number at most trace_shape_timings, else a
designed set and the heaviest shapes, the rest read off a cost model with its held-out error (shape_cost.py);
N > 0 times each padded row count at N + 1 real counts and the real-tokens-alone curve at a few points, and
interpolates the rest (compose.py, which composes the trace).
Shapes already routed or timed by the point before, in the same run and at the same layer parameters (a what-if
axis over capture lists shares most of them), are reused from the run's store (shapes.ShapeStore); the record says
how many. A new run, or a point at other layer parameters in between, starts afresh; `repeat` is a layer parameter
here, so repeats are measured anew. `trace_replay: N` also replays the first N steps one call at a time (each built
and timed afresh: replay.py) and records the composed and replayed totals, the tolerance and the verdict. EP: the
per-rank loads are computed from the routing (the slowest-rank excess), the time is this rank's layer; with
ep_size > 1 the EP step is composed too (ep_measure.py: the slowest rank plus the wire). JIT: the fixed-capacity
dispatch's compiles are predicted from the capacities (capacity_policy, num_max_tokens_per_rank) of each
micro-batch's largest per-rank receive, one compile per distinct capacity (jit_trace measures that prediction).
The record (record.py: TraceHeadline, EPStepRecord, ReplayRecord) states what each phase cost, `phase_wall_s`.

The package: trace_input (the trace and the engine), shapes (one padded shape measured, the shape store),
shape_streams (a shape's rows and routing figures), shape_cost (the shape plan and model), compose (the single-rank
composition and interpolation), steps (per-step records, the step file), headline, ep_step (the EP step's
arithmetic), routes (the source slots' routing), rank_cost (a rank's expert time: the model and the plan),
rank_timing (the rank timer), ep_measure (the EP step measured), wire (the wire model at a point and its card),
replay (both replay checks), record (the typed record), knobs (the sweep keys), checks (the record's consistency),
estimate (what a point costs before it runs).

Case.run (what the runner times) is the masked layer at the trace's most frequent call shape that the device
times (plan.can_time; info.run_shape says which).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from moebench.bench.experts import triton_available
from moebench.bench.layer import layer_point_problem
from moebench.bench.serving_trace import checks  # noqa: F401  (registers the family's consistency checks)
from moebench.bench.serving_trace import steps as step_figures
from moebench.bench.serving_trace.compose import (distinct_shapes, interpolated_timer, interpolation_shapes,
                                                  padded_row_counts)
from moebench.bench.serving_trace.ep_measure import measure_ep_step
from moebench.bench.serving_trace.estimate import point_seconds
from moebench.bench.serving_trace.ep_step import placement_problem
from moebench.bench.serving_trace.headline import trace_headline
from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.record import SIDES, PhaseClock
from moebench.bench.serving_trace.launch import launch_of
from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX, can_time
from moebench.bench.serving_trace.replay import REPLAY_TOLERANCE, single_rank_replay
from moebench.bench.serving_trace.shape_cost import (ShapeTable,
                                                     model_spread_us, plan_shape_times, shape_reads)
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore, measure_shapes
from moebench.bench.serving_trace.step_calls import check_sample, shapes_as_steps, step_calls
from moebench.bench.serving_trace.trace_input import engine_of, trace_tokens
from moebench.check import CheckResult
from moebench.inputs.engine_padding import padding_problem
from moebench.kernels.fused_experts import expert_work
from moebench.measure.cost import PointWork
from moebench.params import Params, Point, Timing
from moebench.registry import Case, RunContext, declare_work, register_impl
from moebench.traces.capture_lists import capture_list_label
from moebench.traces.knobs import TraceKnobs
from moebench.traces.step_file import write_step_columns

__all__ = ["build", "engine_of", "trace_tokens"]

SHAPES_RECORDED_MAX = 5_000  # a trace with more distinct shapes records the timed ones (the step file holds the rest)
# How each shape (and rank workload) is timed: on a GPU measure_settled, at most `iters` samples (eager events where
# the call is GPU-bound, graph replays below); one wall-clock sample under the CPU interpreter (a layer call there
# takes a good fraction of a second).
SHAPE_TIMING = {"cuda": Timing(mode="cuda_graph", warmup=3, iters=20, unroll=1, max_seconds=5.0),
                "cpu": Timing(mode="wall", warmup=0, iters=1, unroll=1, max_seconds=60.0)}


def _validate(p: Params) -> str | None:
    why = layer_point_problem(p)
    if why:
        return why
    if p.ep_mode != "real":
        return "ep_mode: serving_trace computes the EP ranks' loads itself (leave ep_mode: real)"
    t, serving = p.knobs(TraceKnobs), p.knobs(ServingKnobs)
    if p.ep_size > 1 and (why := placement_problem(p.ep_size, serving.dp_size, serving.sp_size)):
        return why
    replay = serving.trace_replay
    if replay and serving.trace_file is None and t.trace is None and replay > t.trace_steps:
        return f"trace_replay: {replay} steps > trace_steps {t.trace_steps}"
    return None


# a point is the trace's shapes and rank workloads timed one by one, and its composition: declared whole
declare_work("serving_trace", PointWork(point=point_seconds))


@register_impl("serving_trace.layer", targets=("serving_trace",), available=triton_available, validate=_validate,
               description="the MoE layer over a serving trace through the engine's padding producers: time masked "
                           "vs oblivious, padding tax, EP excess and fixed-capacity compiles, timed per shape or "
                           "on a grid of real counts per padded row count")
def build(p: Params, ctx: RunContext) -> Case:
    dev = ctx.device
    t0 = time.perf_counter()
    clock = PhaseClock()
    serving = p.knobs(ServingKnobs)
    with clock.phase("host_composition"):
        trace, source = trace_tokens(p)
        engine = engine_of(p)
        counts, index = trace.counts, trace.index
        step_table = step_calls(trace.table(), engine)  # every distinct step's calls, as arrays
        replay_steps = [step_table.step(j) for j in index[:serving.trace_replay].tolist()]
        calls = Counter(step_table.call_counts(counts))  # (rows, real) -> calls over the trace
        call_shapes = shapes_as_steps(sorted(calls))
        shapes = distinct_shapes(call_shapes + replay_steps)
        n = serving.trace_real_points
    kind = "cuda" if dev.type == "cuda" else "cpu"
    store = ShapeStore.of_run(ctx.run_store)
    with clock.phase("routing"):
        streams = store.streams_for(p, dev, max((r for _, r in shapes), default=1),
                                    max((rows - r for rows, r in shapes), default=1))
    bench = ShapeBench(p, dev, SHAPE_TIMING[kind], streams)
    if n:
        timed = interpolation_shapes(call_shapes + replay_steps, n)
        figures, table, measured = measure_shapes(p, bench, shapes, timed, store, ctx.progress, clock)
        time_of = interpolated_timer(table, n)
        shape_plan: dict[str, Any] = {"shape_times": "interpolated", "distinct_shapes": len(shapes),
                                      "shape_timings": len(timed)}
    else:
        figures, _, _ = measure_shapes(p, bench, shapes, [], store, None, clock)
        budget = serving.shape_timings(kind)
        timed_so_far = [0, 0]  # shapes asked for, shapes measured now (the rest reused from the store)

        def time_shapes(batch):
            base, total = timed_so_far[0], min(budget, len(shapes))
            progress = lambda i, _n, what, detail="": ctx.progress(base + i, total, what, detail)  # noqa: E731
            _, got, now = measure_shapes(p, bench, [], list(batch), store, progress, clock)
            timed_so_far[0] += len(batch)
            timed_so_far[1] += now
            return got

        with clock.phase("host_composition"):
            features = ShapeTable(shapes, streams, launch_of(p, dev))
        time_of, shape_plan, table = plan_shape_times(shapes, shape_reads(calls), features, time_shapes, budget,
                                                      REPLAY_TOLERANCE, TIMED_ROWS_MAX[kind])
        timed, measured = sorted({(rows, real) for _, rows, real in table}), timed_so_far[1]
    with clock.phase("host_composition"):
        timed_set = set(timed)
        steps = step_figures.StepFigures(p, step_table, figures, time_of)
        tot = steps.totals(counts)
    info: dict[str, Any] = {
        "trace": {**source, "steps": trace.num_steps, "distinct_steps": step_table.num_steps,
                  "dp_size": serving.dp_size},
        "engine": {"capture_list": capture_list_label(p.capture_sizes), "capture_sizes": list(engine.capture_sizes),
                   "dp_size": serving.dp_size, "sp_size": serving.sp_size, "dbo": serving.dbo, "ep_size": p.ep_size,
                   "num_local_experts": p.local_experts, "expert_dtype": p.expert_dtype},
        "shape_mode": shape_plan["shape_times"], "trace_real_points": n, "shape_plan": shape_plan,
        "distinct_shapes": len(shapes), "distinct_padded_shapes": len(padded_row_counts(call_shapes)),
        "timed_shapes": len(timed), "shape_timings": 2 * len(timed), "shapes_measured": measured,
        "shapes_reused": len(timed) - measured, "layer_calls": sum(calls.values()),
        "shape_timing": {"mode": "settled (events or cuda_graph)" if kind == "cuda" else bench.timing.mode,
                         "iters": bench.timing.iters, "stat": "p50"},
        "headline": None,  # below, with the EP step's
        # each distinct shape's routing figures and the layer time the composition used (measured, or read off
        # the interpolation or the model where the shape was not timed); past SHAPES_RECORDED_MAX, the timed ones
        "shapes": [{**figures[s].as_dict(), "layer_us": {side: round(time_of(side, *s), 3) for side in SIDES},
                    "timed": s in timed_set} for s in (shapes if len(shapes) <= SHAPES_RECORDED_MAX else timed)],
        "ep_loads": "computed from the routing" if p.ep_size > 1 else None,
    }
    ep_record = None
    if p.ep_size > 1:
        ep_record, steps.ep = measure_ep_step(p, dev, bench.timing, step_table, counts, replay_steps, clock,
                                              ctx.progress)
        info["ep_step"] = ep_record.to_info()
    with clock.phase("host_composition"):
        modelled = shape_plan["shape_times"] == "model"
        spread_of = (lambda s: {side: model_spread_us(time_of, shape_plan, side, *s) for side in SIDES}) \
            if modelled else None
        info["headline"] = trace_headline(p, steps, counts, tot, calls, figures, ep_record, spread_of).to_info()
        # every step's figures in the record while the trace is short; a long trace keeps its distinct steps while
        # they are few, and every step's figures go to the run's step file (columns indexed by step)
        info["trace_steps"] = info["distinct_step_records"] = None
        if trace.num_steps <= step_figures.STEP_RECORDS_MAX:
            records = [steps.record(j) for j in range(len(steps))]
            info["trace_steps"] = [{"step": i, **records[j]} for i, j in enumerate(index.tolist())]
        elif len(steps) <= step_figures.STEP_RECORDS_MAX:
            info["distinct_step_records"] = [{"count": int(c), **steps.record(j)} for j, c in enumerate(counts)]
        if ctx.run_dir is not None and ctx.rank == 0:
            info["step_file"] = write_step_columns(ctx.run_dir, Point(0, "serving_trace.layer", p).key,
                                                   step_figures.step_columns(steps, index, serving.dp_size),
                                                   step_figures.STEP_FILE_META)
    if serving.trace_replay:
        with clock.phase("replay"):
            info["replay"] = single_rank_replay(bench, replay_steps, time_of).to_info()
    info["trace_wall_s"] = round(time.perf_counter() - t0, 3)
    info["phase_wall_s"] = clock.record()

    # the runner's p50 call: the most frequent call shape the device times (plan.can_time: a 4096-row layer
    # takes minutes a call in the interpreter)
    timeable = [(n, s) for s, n in calls.items() if can_time(s[0], kind)]
    busiest = (max(timeable, key=lambda ns: (ns[0], -ns[1][0], -ns[1][1]))[1] if timeable
               else min(calls, key=lambda s: (s[0], s[1])) if calls else shapes[0] if shapes else (1, 1))
    sp, batch = bench.batch(*busiest)
    pipe = bench.pipeline(sp, batch, "masked")
    info["run_shape"] = {"rows": busiest[0], "real": busiest[1], "side": "masked",
                         "calls": calls.get(busiest, 0), "most_frequent": calls.most_common(1)[0][0] == busiest
                         if calls else True}
    ids = pipe.router_reference().ids.to(torch.int64)
    local = (ids >= 0) & (ids < p.local_experts)
    flops, bytes_moved = expert_work(int(local.sum()), int(torch.unique(ids[local]).numel()),
                                     int(local.any(dim=1).sum()), p.hidden, p.intermediate)
    # the check's shape: the most padded one the device times (the interpreter's layer takes ~15 ms a row)
    checkable = [s for s in shapes if can_time(s[0], kind)] or shapes
    most_padded = max(checkable, key=lambda s: (s[0] - s[1], s[0])) if shapes else busiest

    def check() -> CheckResult:
        # every distinct step is what the tensor producers make of its real tokens, the composition reads back
        # every timed shape as measured, and the most padded shape's layers are right
        problems = []
        for i in check_sample(step_table.num_steps).tolist():
            why = padding_problem(step_table.step(i), engine)
            if why:
                problems.append(why)
        for side, rows, real in table:
            if not (rows == real or real == 0 or (side, real, real) in table):
                continue  # its padding's part is the model's difference (shape_cost): read as composed, not timed
            got = time_of(side, rows, real)
            if got != table[(side, rows, real)]:
                problems.append(f"{side} ({rows}, {real}): composed from {got}, measured {table[(side, rows, real)]}")
        composition = CheckResult(not problems, "; ".join(problems[:3]),
                                  {"distinct_shapes": float(len(shapes))})
        return CheckResult.merge(composition, bench.check_shape(*most_padded))

    def cleanup() -> None:
        nonlocal pipe
        pipe = None

    return Case(run=lambda: pipe.run(), check=check, flops=flops, bytes_moved=bytes_moved,
                bytes_note="run(): the masked layer at the most frequent call shape, its experts' useful work",
                info=info, nvtx_stage="layer", cleanup=cleanup)
