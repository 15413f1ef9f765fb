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
Shapes already routed or timed by the point before, in the same run and at the same layer parameters (a what-if axis
over capture lists shares most of them), are reused from the run's store (shapes.ShapeStore); the record says how
many. A new run, or a point at other layer parameters in between, starts afresh; `repeat` is a layer parameter here,
so repeats are measured anew. `trace_replay: N` also replays the first N steps one call at a time (each built and
timed afresh: replay.py) and records the composed and replayed totals, the tolerance and the verdict. EP: the
per-rank loads are computed from the routing (the slowest-rank excess), the time is this rank's layer; with ep_size
> 1 the EP step is composed too (ep_measure.py: the slowest rank plus the wire; the run's rank timings at a layer
point are shared by its points, rank_timing.RankStore, so a workload has one time in the run). JIT: the
fixed-capacity dispatch's compiles are predicted from the capacities (capacity_policy, num_max_tokens_per_rank) of
each micro-batch's largest per-rank receive, one compile per distinct capacity (jit_trace measures that prediction).
The record (trace_record.TraceRecord, built whole and written as info) states what each phase cost, `phase_wall_s`.

The package: trace_input (the trace and the engine), step_calls (every distinct step's calls as arrays), shapes (one
padded shape measured, the shape store, the shapes' figures as arrays), shape_streams (a shape's rows and routing
figures), plan (the timed-sample engine both models use), launch (the kernel's launch as the models see it),
shape_cost (the shape plan and model), compose (the shapes to time, interpolation, a step's composition), steps
(every step's figures as columns, the step file), headline, ep_step (the EP step of one step), ep_arrays (of every
distinct step at once), routes (the source slots' routing), rank_cost (a rank's expert time: the model), rank_plan
(which workloads are timed), rank_timing (the rank timer and the run's rank store), ep_measure (the EP step
measured), wire (the wire model at a point and its card), replay (both replay checks), record (the typed record's
parts), trace_record (the record, whole), knobs (the sweep keys), checks (the record's consistency), estimate (what
a point costs before it runs), capture_pricing (the capture-list search's prices).

Case.run (what the runner times) is the masked layer at the trace's most frequent call shape that the device
times (plan.can_time; info.run_shape says which).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

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
from moebench.bench.serving_trace.record import SIDES, EPStepRecord, PhaseClock, ShapePlan, TraceHeadline
from moebench.bench.serving_trace.launch import launch_of
from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX, can_time
from moebench.bench.serving_trace.masked_steps import MaskedStepStore, config_key as masked_config_key
from moebench.bench.serving_trace.rank_timing import RankStore
from moebench.bench.serving_trace.replay import REPLAY_TOLERANCE, single_rank_replay
from moebench.bench.serving_trace.shape_cost import (ShapeTable,
                                                     model_spread_us, plan_shape_times, shape_reads)
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore, layer_key, measure_shapes
from moebench.bench.serving_trace.trace_record import TraceRecord
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


def point_problem(p: Params) -> str | None:
    """Why point p is no serving_trace point, or None (the impl's validate; serving_trace.capture_search's too)."""
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


@register_impl("serving_trace.layer", targets=("serving_trace",), available=triton_available,
               validate=point_problem, description="the MoE layer over a serving trace through the engine's padding producers: time masked "
                           "vs oblivious, padding tax, EP excess and fixed-capacity compiles, timed per shape or "
                           "on a grid of real counts per padded row count")
def build(p: Params, ctx: RunContext) -> Case:
    t0 = time.perf_counter()
    clock = PhaseClock()
    serving = p.knobs(ServingKnobs)
    kind = "cuda" if ctx.device.type == "cuda" else "cpu"
    with clock.phase("host_composition"):
        tc = _trace_calls(p, serving)
    store = ShapeStore.of_run(ctx.run_store)
    with clock.phase("routing"):
        streams = store.streams_for(p, ctx.device, max((r for _, r in tc.shapes), default=1),
                                    max((rows - r for rows, r in tc.shapes), default=1))
    bench = ShapeBench(p, ctx.device, SHAPE_TIMING[kind], streams)
    st = _shape_times(p, ctx, bench, tc, store, clock, kind)
    with clock.phase("host_composition"):
        steps = step_figures.StepFigures(p, tc.step_table, st.figures, st.time_of)
        tot = steps.totals(tc.trace.counts)
    ep_record = None
    if p.ep_size > 1:
        ep_record, steps.ep = measure_ep_step(
            p, ctx.device, bench.timing, tc.step_table, tc.trace.counts, tc.replay_steps, clock, ctx.progress,
            RankStore.of_run(ctx.run_store).for_layer(layer_key(p, ctx.device)),
            MaskedStepStore.of_run(ctx.run_store).for_config(masked_config_key(p, ctx.device)))
    with clock.phase("host_composition"):
        spread_of = (lambda s: {side: model_spread_us(st.time_of, st.plan, side, *s) for side in SIDES}) \
            if st.plan.shape_times == "model" else None
        headline = trace_headline(p, steps, tc.trace.counts, tot, tc.calls, st.figures, ep_record, spread_of)
        record = _trace_record(p, serving, tc, st, bench, kind, headline, ep_record)
        _step_records(p, ctx, serving, tc, steps, record)
    if serving.trace_replay:
        with clock.phase("replay"):
            record.replay = single_rank_replay(bench, tc.replay_steps, st.time_of)
    record.trace_wall_s = round(time.perf_counter() - t0, 3)
    record.phase_wall_s = clock.record()
    return _point_case(p, bench, tc, st, record, kind)


@dataclass
class _TraceCalls:
    """The trace of a point and its calls: the distinct steps' calls as arrays, the replayed steps, every call
    shape with the calls over the trace that have it, and the shapes to route (the calls' and their real tokens')."""

    trace: Any
    source: dict
    engine: Any
    step_table: Any
    replay_steps: list
    calls: Counter
    call_shapes: list
    shapes: list


def _trace_calls(p: Params, serving: ServingKnobs) -> _TraceCalls:
    trace, source = trace_tokens(p)
    engine = engine_of(p)
    step_table = step_calls(trace.table(), engine)
    replay_steps = [step_table.step(j) for j in trace.index[:serving.trace_replay].tolist()]
    calls = Counter(step_table.call_counts(trace.counts))
    call_shapes = shapes_as_steps(sorted(calls))
    return _TraceCalls(trace, source, engine, step_table, replay_steps, calls, call_shapes,
                       distinct_shapes(call_shapes + replay_steps))


@dataclass
class _ShapeTimes:
    """How the point's shapes were priced: their figures, the layer time of a call shape, the plan's record, the
    timings {(side, rows, real): us}, the shapes timed and how many of them now (the rest from the run's store)."""

    figures: Any
    time_of: Callable[[str, int, int], float]
    plan: ShapePlan
    table: dict
    timed: list
    measured: int


def _shape_times(p: Params, ctx: RunContext, bench: ShapeBench, tc: _TraceCalls, store: ShapeStore,
                 clock: PhaseClock, kind: str) -> _ShapeTimes:
    """Interpolated (trace_real_points N > 0: compose.py) or every shape timed or a designed set and the model
    (shape_cost.plan_shape_times)."""
    serving = p.knobs(ServingKnobs)
    n = serving.trace_real_points
    if n:
        timed = interpolation_shapes(tc.call_shapes + tc.replay_steps, n)
        figures, table, measured = measure_shapes(p, bench, tc.shapes, timed, store, ctx.progress, clock)
        return _ShapeTimes(figures, interpolated_timer(table, n), ShapePlan("interpolated", len(tc.shapes), len(timed)),
                           table, timed, measured)
    figures, _, _ = measure_shapes(p, bench, tc.shapes, [], store, None, clock)
    budget = serving.shape_timings(kind)
    timed_so_far = [0, 0]  # shapes asked for, shapes measured now (the rest reused from the store)

    def time_shapes(batch):
        base, total = timed_so_far[0], min(budget, len(tc.shapes))
        progress = lambda i, _n, what, detail="": ctx.progress(base + i, total, what, detail)  # noqa: E731
        _, got, now = measure_shapes(p, bench, [], list(batch), store, progress, clock)
        timed_so_far[0] += len(batch)
        timed_so_far[1] += now
        return got

    with clock.phase("host_composition"):
        features = ShapeTable(tc.shapes, bench.streams, launch_of(p, ctx.device))
    time_of, plan, table = plan_shape_times(tc.shapes, shape_reads(tc.calls), features, time_shapes, budget,
                                            REPLAY_TOLERANCE, TIMED_ROWS_MAX[kind])
    return _ShapeTimes(figures, time_of, plan, table, sorted({(rows, real) for _, rows, real in table}),
                       timed_so_far[1])


def _trace_record(p: Params, serving: ServingKnobs, tc: _TraceCalls, st: _ShapeTimes, bench: ShapeBench, kind: str,
                  headline: TraceHeadline, ep_record: EPStepRecord | None) -> TraceRecord:
    """The record but for the per-step records, the replay and the phases: the trace, the engine, how the shapes
    were timed, each distinct shape's routing figures and the layer time the composition used (measured, or read
    off the interpolation or the model where the shape was not timed; past SHAPES_RECORDED_MAX, the timed ones),
    the headline and the EP step."""
    timed_set = set(st.timed)
    recorded = tc.shapes if len(tc.shapes) <= SHAPES_RECORDED_MAX else st.timed
    return TraceRecord(
        trace={**tc.source, "steps": tc.trace.num_steps, "distinct_steps": tc.step_table.num_steps,
               "dp_size": serving.dp_size},
        engine={"capture_list": capture_list_label(p.capture_sizes), "capture_sizes": list(tc.engine.capture_sizes),
                "dp_size": serving.dp_size, "sp_size": serving.sp_size, "dbo": serving.dbo, "ep_size": p.ep_size,
                "num_local_experts": p.local_experts, "expert_dtype": p.expert_dtype},
        distinct_shapes=len(tc.shapes), headline=headline, trace_real_points=serving.trace_real_points,
        timed_shapes=len(st.timed), ep_step=ep_record, shape_plan=st.plan, shape_mode=st.plan.shape_times,
        distinct_padded_shapes=len(padded_row_counts(tc.call_shapes)), shape_timings=2 * len(st.timed),
        shapes_measured=st.measured, shapes_reused=len(st.timed) - st.measured, layer_calls=sum(tc.calls.values()),
        shape_timing={"mode": "settled (events or cuda_graph)" if kind == "cuda" else bench.timing.mode,
                      "iters": bench.timing.iters, "stat": "p50"},
        shapes=[{**st.figures[s].as_dict(), "layer_us": {side: round(st.time_of(side, *s), 3) for side in SIDES},
                 "timed": s in timed_set} for s in recorded],
        ep_loads="computed from the routing" if p.ep_size > 1 else None)


def _step_records(p: Params, ctx: RunContext, serving: ServingKnobs, tc: _TraceCalls, steps,
                  record: TraceRecord) -> None:
    """Every step's figures in the record while the trace is short; a long trace keeps its distinct steps while
    they are few, and every step's figures go to the run's step file (columns indexed by step)."""
    index, counts = tc.trace.index, tc.trace.counts
    if tc.trace.num_steps <= step_figures.STEP_RECORDS_MAX:
        records = [steps.record(j) for j in range(len(steps))]
        record.trace_steps = [{"step": i, **records[j]} for i, j in enumerate(index.tolist())]
    elif len(steps) <= step_figures.STEP_RECORDS_MAX:
        record.distinct_step_records = [{"count": int(c), **steps.record(j)} for j, c in enumerate(counts)]
    if ctx.run_dir is not None and ctx.rank == 0:
        record.step_file = write_step_columns(ctx.run_dir, Point(0, "serving_trace.layer", p).key,
                                              step_figures.step_columns(steps, index, serving.dp_size),
                                              step_figures.STEP_FILE_META)


def _point_case(p: Params, bench: ShapeBench, tc: _TraceCalls, st: _ShapeTimes, record: TraceRecord, kind: str
                ) -> Case:
    """The runner's Case: its timed call the masked layer at the most frequent call shape the device times
    (plan.can_time: a 4096-row layer takes minutes a call in the interpreter); its check every sampled distinct
    step against the tensor producers, every timed shape read back as measured, and the layers at the most
    padded shape the device times."""
    calls = tc.calls
    timeable = [(n, s) for s, n in calls.items() if can_time(s[0], kind)]
    busiest = (max(timeable, key=lambda ns: (ns[0], -ns[1][0], -ns[1][1]))[1] if timeable
               else min(calls) if calls else tc.shapes[0] if tc.shapes else (1, 1))
    sp, batch = bench.batch(*busiest)
    pipe = bench.pipeline(sp, batch, "masked")
    record.run_shape = {"rows": busiest[0], "real": busiest[1], "side": "masked", "calls": calls.get(busiest, 0),
                        "most_frequent": calls.most_common(1)[0][0] == busiest if calls else True}
    ids = pipe.router_reference().ids.to(torch.int64)
    local = (ids >= 0) & (ids < p.local_experts)
    flops, bytes_moved = expert_work(int(local.sum()), int(torch.unique(ids[local]).numel()),
                                     int(local.any(dim=1).sum()), p.hidden, p.intermediate)
    checkable = [s for s in tc.shapes if can_time(s[0], kind)] or tc.shapes
    most_padded = max(checkable, key=lambda s: (s[0] - s[1], s[0])) if tc.shapes else busiest
    table, time_of = st.table, st.time_of

    def check() -> CheckResult:
        problems = []
        for i in check_sample(tc.step_table.num_steps).tolist():
            why = padding_problem(tc.step_table.step(i), tc.engine)
            if why:
                problems.append(why)
        for side, rows, real in table:
            if not (rows == real or real == 0 or (side, real, real) in table):
                continue  # its padding's part is the model's difference (shape_cost): read as composed, not timed
            got = time_of(side, rows, real)
            if got != table[(side, rows, real)]:
                problems.append(f"{side} ({rows}, {real}): composed from {got}, measured {table[(side, rows, real)]}")
        composition = CheckResult(not problems, "; ".join(problems[:3]), {"distinct_shapes": float(len(tc.shapes))})
        return CheckResult.merge(composition, bench.check_shape(*most_padded))

    def cleanup() -> None:
        nonlocal pipe
        pipe = None

    return Case(run=lambda: pipe.run(), check=check, flops=flops, bytes_moved=bytes_moved,
                bytes_note="run(): the masked layer at the most frequent call shape the device times, its "
                           "experts' useful work", info=record.to_info(), nvtx_stage="layer", cleanup=cleanup)
