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
divisibility), giving its layer calls (rows, real). Every distinct shape's routing figures are computed
(shapes.py: make_batch and route, no timing). The timings (both sides' layers built once and timed) follow
trace_real_points: 0 times every distinct shape; N > 0 times each padded row count at N + 1 real counts and the
real-tokens-alone curve at a few points, and interpolates the rest (compose.py, which composes the trace).
Shapes already routed or timed by the point before, in the same run and at the same layer parameters (a what-if
axis over capture lists shares most of them), are reused; the record says how many. A new run, or a point at other
layer parameters in between, starts afresh; `repeat` is a layer parameter here, so repeats are measured anew.
`trace_replay: N` also replays the first N steps one call at a time (each built and timed afresh) and records the
composed and replayed totals. EP: the per-rank loads are computed from the routing (the slowest-rank excess), the
time is this rank's layer; real EP ranks are not run by this target. JIT: the fixed-capacity dispatch's compiles
are predicted from the capacities (capacity_policy, num_max_tokens_per_rank) of each micro-batch's largest
per-rank receive, one compile per distinct capacity (jit_trace measures that prediction).

Case.run (what the runner times) is the masked layer at the trace's most frequent call shape.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from moebench.bench.serving_trace.compose import (
    SIDES,
    compose,
    distinct_shapes,
    headline,
    interpolated_timer,
    interpolation_shapes,
    padded_row_counts,
    replay,
    share,
    totals,
)
from moebench.bench.serving_trace.ep_step import placement_problem
from moebench.bench.serving_trace.ep_measure import measure_ep_step
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeFigures
from moebench.bench.experts import triton_available
from moebench.bench.layer import layer_point_problem
from moebench.check import CheckResult
from moebench.dispatch.pack import CapacityKnobs, capacity_for
from moebench.inputs.engine_padding import Engine, StepPadding, padding_problem, step_padding
from moebench.kernels.fused_experts import expert_work
from moebench.params import Params, Point, Timing
from moebench.registry import Case, RunContext, register_impl
from moebench.traces.capture_lists import capture_list_label, resolve_capture_sizes
from moebench.traces.csv_trace import read_trace_file
from moebench.traces.distinct import DistinctSteps, distinct_steps
from moebench.traces.distributions import rank_tokens
from moebench.traces.knobs import ServingKnobs, TraceKnobs
from moebench.traces.step_file import write_step_columns

# How each shape is timed: one CUDA-graph replay per sample on a GPU (what a serving engine replays; unroll 1 keeps
# the cost per shape fixed: the scenario's 1000 steps time about 550 shapes per capture list), one wall-clock
# sample under the CPU interpreter (a layer call there takes a good fraction of a second).
SHAPE_TIMING = {"cuda": Timing(mode="cuda_graph", warmup=3, iters=20, unroll=1, max_seconds=5.0),
                "cpu": Timing(mode="wall", warmup=0, iters=1, unroll=1, max_seconds=60.0)}
# Parameters that shape the trace or the engine, not the layer: shapes measured at one layer point are reused
# across points differing only by these.
# (`repeat` is not one of them: a repeat point measures its shapes again, as repeats are meant to)
_TRACE_KEYS = ("capture_sizes", "dp_size", "sp_size", "dbo", "trace", "trace_file", "trace_steps",
               "trace_distribution", "trace_max_tokens", "trace_replay", "capacity_policy",
               "num_max_tokens_per_rank", "num_tokens", "padding_ratio", "padding_producer",
               "trace_real_points", "ep_rank_timings", "ranks_per_node", "wire_intra_gbps",
               "wire_intra_latency_us", "wire_inter_gbps", "wire_inter_latency_us", "dispatch_calibration",
               "wire_path")
# one layer point's shapes by (rows, real), routed, timed or both (exact shapes and grid points share entries); a
# new layer point or a new run clears it
_SHAPES: dict[tuple[int, int], ShapeFigures] = {}
STEP_RECORDS_MAX = 5_000  # longer traces keep one record per distinct step (with its count) instead of every step
_SHAPES_OWNER: list = [None]


def trace_tokens(p: Params) -> tuple[DistinctSteps, dict[str, Any]]:
    """(the trace's distinct steps of per-DP-rank real tokens with their counts and per-step index, where they came
    from). A trace file's table is read once, streaming; no Python object is made per step."""
    t, serving = p.knobs(TraceKnobs), p.knobs(ServingKnobs)
    if serving.trace_file is not None:
        f = read_trace_file(serving.trace_file)
        return f.distinct_steps(serving.dp_size), {"source": "file", "file": f.path, "sha256": f.sha256,
                                                   "columns": f.columns}
    if t.trace is not None:
        return distinct_steps([[int(b)] * serving.dp_size for b in t.trace]), {"source": "explicit"}
    per_rank = [rank_tokens(t.trace_distribution, t.trace_steps, t.trace_max_tokens, p.seed, rank)
                for rank in range(serving.dp_size)]
    return distinct_steps([list(step) for step in zip(*per_rank)]), {"source": t.trace_distribution}


def engine_of(p: Params) -> Engine:
    serving = p.knobs(ServingKnobs)
    return Engine(tuple(resolve_capture_sizes(p.capture_sizes)), serving.dp_size, serving.sp_size, serving.dbo)


def _layer_key(p: Params, ctx: RunContext) -> tuple:
    d = p.to_dict()
    # the token itself (kept alive here, compared by identity); a point on its own shares nothing
    return (ctx.run_token if ctx.run_token is not None else object(), str(ctx.device),
            tuple(sorted((k, repr(v)) for k, v in d.items() if k not in _TRACE_KEYS)))


def _cached(shape: tuple[int, int]) -> ShapeFigures:
    if shape not in _SHAPES:
        _SHAPES[shape] = ShapeFigures(shape[0], shape[1], {}, {}, {}, {})
    return _SHAPES[shape]


def measure_shapes(p: Params, bench: ShapeBench, routed: list[tuple[int, int]], timed: list[tuple[int, int]],
                   ctx: RunContext) -> tuple[dict[tuple[int, int], ShapeFigures], dict, int]:
    """The routing figures of every `routed` shape, the timing table {(side, rows, real): us} of every `timed`
    one (reusing this run's earlier work at the same layer point), and the count of shapes timed now."""
    owner = _layer_key(p, ctx)
    if _SHAPES_OWNER[0] != owner:
        _SHAPES.clear()
        _SHAPES_OWNER[0] = owner
    for shape in routed:
        entry = _cached(shape)
        if not entry.padding_gemm_rows:
            f = bench.shape_figures(*shape)
            entry.padding_gemm_rows, entry.rank_loads, entry.max_rows_per_rank = (
                f.padding_gemm_rows, f.rank_loads, f.max_rows_per_rank)
    timed_now = 0
    for i, shape in enumerate(timed):
        entry = _cached(shape)
        ctx.progress(i, len(timed), "trace shapes timed", f"rows {shape[0]}, real {shape[1]}")
        if not entry.layer_us:
            entry.layer_us = bench.time_shape(*shape)
            entry.layer_spread_us = dict(bench.last_spreads_us)
            timed_now += 1
    table = {(side, *shape): _SHAPES[shape].layer_us[side] for shape in timed for side in SIDES}
    return {s: _SHAPES[s] for s in routed}, table, timed_now


def _capacities(step: StepPadding, figures: dict, side: str, p: Params) -> list[int]:
    """Per micro-batch: the fixed-capacity dispatch's capacity (the largest per-rank receive of its calls)."""
    caps = []
    for m in range(len(step.micro_batch_rows)):
        need = max((figures[(c.rows, c.real)].max_rows_per_rank[side] for c in step.calls if c.micro_batch == m),
                   default=0)
        # a receive larger than the buffer would not fit any capacity: it is counted at the buffer's capacity
        cap = p.knobs(CapacityKnobs)
        caps.append(capacity_for(cap.capacity_policy, min(need, cap.num_max_tokens_per_rank),
                                 cap.num_max_tokens_per_rank))
    return caps


def _ep_excess(step: StepPadding, figures: dict, side: str) -> float:
    """The slowest EP rank's routes over the mean rank's, summed over the step's micro-batches: the calls of one
    micro-batch (every DP and SP rank) dispatch to the same EP ranks together, so their loads add up first."""
    excess = 0.0
    for m in range(len(step.micro_batch_rows)):
        loads = [0] * len(next(iter(figures.values())).rank_loads[side]) if figures else []
        for c in step.calls:
            if c.micro_batch == m:
                loads = [a + b for a, b in zip(loads, figures[(c.rows, c.real)].rank_loads[side])]
        if loads:
            excess += max(loads) - sum(loads) / len(loads)
    return excess


def step_records(p: Params, paddings, per_step, figures) -> list[dict[str, Any]]:
    """One record per distinct step (its real tokens, the rows each producer added, both sides' single-rank
    layer times, padded GEMM rows, EP excess routes and fixed-capacity capacities)."""
    out = []
    for step, times in zip(paddings, per_step):
        rec: dict[str, Any] = {
            "real": list(step.real), "cudagraph_rows": list(step.cudagraph_rows), "dp_rows": step.dp_rows,
            "micro_batch_rows": list(step.micro_batch_rows), "sp_rows": list(step.sp_rows),
            "chunk_rows": list(step.chunk_rows), "calls": len(step.calls),
            "rows": sum(c.rows for c in step.calls), "padded_rows": step.padded_rows,
            "added_rows": step.added_rows(),
            "layer_us": {s: round(v, 3) for s, v in times["layer_us"].items()},
            "real_only_us": {s: round(v, 3) for s, v in times["real_only_us"].items()},
            "padding_gemm_rows": {s: sum(figures[(c.rows, c.real)].padding_gemm_rows[s] for c in step.calls)
                                  for s in SIDES},
            "ep_excess_routes": {s: _ep_excess(step, figures, s) for s in SIDES}}
        if p.ep_size > 1:
            rec["capacity"] = {s: _capacities(step, figures, s, p) for s in SIDES}
        out.append(rec)
    return out


# the step file's columns: (column, what the figure is); per side for the timed ones
STEP_FILE_META = {"columns": {
    "real_dp<r>": "real tokens of DP rank r", "rows": "rows over the step's layer calls",
    "padded_rows": "padded rows over them", "distinct_step": "which distinct step (info.distinct_step_records)",
    "layer_us_<side>": "the single-rank view's layer time over the step's calls",
    "ep_step_us_<side>": "the EP step: dispatch + the slowest rank's experts + combine",
    "ep_experts_us_<side>": "the slowest rank's expert time", "ep_mean_rank_us_<side>": "the mean rank's",
    "ep_dispatch_us_<side>": "dispatch (wire model)", "ep_combine_us_<side>": "combine (wire model)",
    "ep_slowest_rank_<side>": "the slowest EP rank"}}


def step_columns(distinct: list[dict], index, dp_size: int) -> dict[str, np.ndarray]:
    """Every step's figures as columns (each distinct step's, read through the per-step index)."""
    idx = np.asarray(index, dtype=np.int64)
    cols: dict[str, np.ndarray] = {"distinct_step": idx.astype(np.int32)}

    def column(values, dtype) -> np.ndarray:
        return np.asarray(values, dtype=dtype)[idx]

    for r in range(dp_size):
        cols[f"real_dp{r}"] = column([d["real"][r] for d in distinct], np.int32)
    cols["rows"] = column([d["rows"] for d in distinct], np.int32)
    cols["padded_rows"] = column([d["padded_rows"] for d in distinct], np.int32)
    for side in SIDES:
        cols[f"layer_us_{side}"] = column([d["layer_us"][side] for d in distinct], np.float32)
        if distinct and "ep_step_us" in distinct[0]:
            for name in ("ep_step_us", "ep_experts_us", "ep_mean_rank_us", "ep_dispatch_us", "ep_combine_us"):
                cols[f"{name}_{side}"] = column([d[name][side] for d in distinct], np.float32)
            cols[f"ep_slowest_rank_{side}"] = column([d["ep_slowest_rank"][side] for d in distinct], np.int32)
    return cols


def _ep_fields(ep: dict) -> dict[str, Any]:
    """A step's EP-step figures, per side (the per-step records and the step file's columns)."""
    return {"ep_step_us": {s: round(v.step_us, 3) for s, v in ep.items()},
            "ep_experts_us": {s: round(v.experts_us, 3) for s, v in ep.items()},
            "ep_mean_rank_us": {s: round(v.mean_rank_us, 3) for s, v in ep.items()},
            "ep_dispatch_us": {s: round(v.dispatch_us, 3) for s, v in ep.items()},
            "ep_combine_us": {s: round(v.combine_us, 3) for s, v in ep.items()},
            "ep_slowest_rank": {s: v.slowest_rank for s, v in ep.items()}}


def trace_headline(p: Params, distinct: list[dict], counts: list[int], tot: dict) -> dict[str, Any]:
    """The single-rank headline over the trace (each distinct step weighted by how often it occurs)."""
    head = headline(tot)
    real_rows = sum(n * sum(s["real"]) for s, n in zip(distinct, counts))
    padded = sum(n * s["padded_rows"] for s, n in zip(distinct, counts))
    head.update(view="single_rank: this EP rank's layer over its own calls (router, align, its local experts, "
                     "reduce); no straggler, no wire",
                real_tokens=real_rows, padded_rows=padded,
                padding_row_share=padded / (padded + real_rows) if padded + real_rows else None,
                padding_gemm_rows={s: sum(n * st["padding_gemm_rows"][s] for st, n in zip(distinct, counts))
                                   for s in SIDES},
                ep_excess_routes={s: sum(n * st["ep_excess_routes"][s] for st, n in zip(distinct, counts))
                                  for s in SIDES})
    head["ep_excess_from_padding"] = head["ep_excess_routes"]["oblivious"] - head["ep_excess_routes"]["masked"]
    if p.ep_size > 1:
        head["jit_compiles"] = {s: len({c for st in distinct for c in st["capacity"][s]}) for s in SIDES}
    else:
        head["jit_compiles"] = {s: None for s in SIDES}  # one rank: no dispatch to size
    return head


def noise(calls: Counter, figures: dict, tot: dict) -> dict[str, Any]:
    """How far the trace's padding time and the masks' saving could move with the timings' spread: per shape, half
    its samples' p10-p90 spread times the calls that read it (one shape's error repeats in every call of it),
    summed in quadrature over shapes (their errors are independent); a conservative bound (the p50's own error is
    smaller than the samples' spread). A padded call's padding time reads its shape and its real tokens alone (an
    unpadded call's is exactly 0); the saving reads every call's shape on both sides. None where a shape has no
    spread (too few samples, or not timed)."""
    padding_reads: Counter = Counter()
    for (rows, real), n in calls.items():
        if rows != real:
            padding_reads[(rows, real)] += n
            if real:
                padding_reads[(real, real)] += n

    def spread(shape):
        got = figures[shape].layer_spread_us if shape in figures else {}
        return None if any(got.get(side) is None for side in SIDES) else got

    if any(spread(s) is None for s in set(padding_reads) | set(calls)):
        return {"padding_us": {side: None for side in SIDES}, "recovered_us": None,
                "within_noise": {"padding_tax": {side: None for side in SIDES}, "recovered": None}}
    pad = {side: sum((n * spread(s)[side]) ** 2 for s, n in padding_reads.items()) ** 0.5 for side in SIDES}
    rec = sum((n * spread(s)[side]) ** 2 for s, n in calls.items() for side in SIDES) ** 0.5
    recovered = tot["layer_us"]["oblivious"] - tot["layer_us"]["masked"]
    return {"padding_us": {side: round(v, 3) for side, v in pad.items()}, "recovered_us": round(rec, 3),
            "within_noise": {"padding_tax": {side: abs(tot["padding_us"][side]) <= pad[side] for side in SIDES},
                             "recovered": abs(recovered) <= rec}}


def ep_headline(ep_info: dict) -> dict[str, Any]:
    """The EP step's headline: step time per side, the tax of padding and its split, the straggler wait."""
    tot, tax = ep_info["totals"], ep_info["tax"]
    step = {s: tot[s]["step_us"] for s in SIDES}
    return {"step_us": step, "experts_us": {s: tot[s]["experts_us"] for s in SIDES},
            "mean_rank_us": {s: tot[s]["mean_rank_us"] for s in SIDES},
            "straggler_wait_us": tax["straggler_wait_us"],
            "wire_us": {s: round(tot[s]["dispatch_us"] + tot[s]["combine_us"], 3) for s in SIDES},
            "dispatch_us": {s: tot[s]["dispatch_us"] for s in SIDES},
            "combine_us": {s: tot[s]["combine_us"] for s in SIDES},
            "padding_tax": share(tax["total_us"], step["oblivious"]),
            "tax_split_us": {k: tax[k] for k in ("gemm_us", "straggler_us", "wire_us", "overlap_us", "total_us")},
            "slowest_rank_padded_route_share": ep_info["slowest_rank_padded_route_share"],
            "rank_times": ep_info["rank_times"]}


def _time(time_of, side: str, rows: int, real: int) -> float:
    return time_of(side, rows, real) if callable(time_of) else time_of[(side, rows, real)]


def _replay_check(bench: ShapeBench, steps, time_of) -> dict[str, Any]:
    """The trace's first steps replayed call by call (fresh batches and pipelines, the exact call shapes),
    against the composition of the same steps (in interpolated mode: what validates the interpolation)."""

    def fresh(side: str, rows: int, real: int) -> float:
        sp, batch = bench.batch(rows, real)
        return bench.time_side(sp, batch, side)

    t0 = time.perf_counter()
    replayed_tot, composed_tot = totals(replay(steps, fresh)), totals(compose(steps, time_of))
    replayed, composed = replayed_tot["layer_us"], composed_tot["layer_us"]
    rel = {s: abs(composed[s] - replayed[s]) / replayed[s] if replayed[s] else None for s in SIDES}
    # the split too: the replay times every call's real tokens alone afresh, so its padding time is the
    # call-by-call one the composition's tax must agree with
    tax = {name: {s: share(tot["padding_us"][s], tot["layer_us"][s]) for s in SIDES}
           for name, tot in (("composed", composed_tot), ("replayed", replayed_tot))}
    return {"steps": len(steps), "calls": sum(len(s.calls) for s in steps), "composed_us": composed,
            "replayed_us": replayed, "rel_diff": rel, "wall_s": round(time.perf_counter() - t0, 3),
            "within_5pct": {s: rel[s] is not None and rel[s] <= 0.05 for s in SIDES},
            "composed_padding_us": composed_tot["padding_us"], "replayed_padding_us": replayed_tot["padding_us"],
            "composed_tax": tax["composed"], "replayed_tax": tax["replayed"]}


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


@register_impl("serving_trace.layer", targets=("serving_trace",), available=triton_available, validate=_validate,
               description="the MoE layer over a serving trace through the engine's padding producers: time masked "
                           "vs oblivious, padding tax, EP excess and fixed-capacity compiles, timed per shape or "
                           "on a grid of real counts per padded row count")
def build(p: Params, ctx: RunContext) -> Case:
    dev = ctx.device
    t0 = time.perf_counter()
    serving = p.knobs(ServingKnobs)
    trace, source = trace_tokens(p)
    engine = engine_of(p)
    counts, index = trace.counts.tolist(), trace.index
    paddings = [step_padding(real, engine) for real in trace.steps]  # one per distinct step
    replay_steps = [paddings[j] for j in index[:serving.trace_replay].tolist()]
    shapes = distinct_shapes(paddings + replay_steps)
    bench = ShapeBench(p, dev, SHAPE_TIMING["cuda" if dev.type == "cuda" else "cpu"])
    n = serving.trace_real_points
    timed = interpolation_shapes(paddings + replay_steps, n) if n else shapes
    figures, table, measured = measure_shapes(p, bench, shapes, timed, ctx)
    time_of = interpolated_timer(table, n) if n else table
    timed_set = set(timed)
    per_step = compose(paddings, time_of)
    distinct = step_records(p, paddings, per_step, figures)
    tot = totals(per_step, counts)
    calls: Counter = Counter()
    for step, count in zip(paddings, counts):
        for c in step.calls:
            calls[(c.rows, c.real)] += count
    info: dict[str, Any] = {
        "trace": {**source, "steps": trace.num_steps, "distinct_steps": len(paddings),
                  "dp_size": serving.dp_size},
        "engine": {"capture_list": capture_list_label(p.capture_sizes), "capture_sizes": list(engine.capture_sizes),
                   "dp_size": serving.dp_size, "sp_size": serving.sp_size, "dbo": serving.dbo, "ep_size": p.ep_size,
                   "num_local_experts": p.local_experts, "expert_dtype": p.expert_dtype},
        "shape_mode": "interpolated" if n else "exact", "trace_real_points": n,
        "distinct_shapes": len(shapes), "distinct_padded_shapes": len(padded_row_counts(paddings)),
        "timed_shapes": len(timed), "shape_timings": 2 * len(timed), "shapes_measured": measured,
        "shapes_reused": len(timed) - measured, "layer_calls": sum(calls.values()),
        "shape_timing": {"mode": bench.timing.mode, "iters": bench.timing.iters, "stat": "p50"},
        "headline": {**trace_headline(p, distinct, counts, tot), "noise": noise(calls, figures, tot)},
        # each distinct shape's routing figures and the layer time the composition used (measured, or read off
        # the interpolation where the shape was not timed)
        "shapes": [{**figures[s].as_dict(), "layer_us": {side: round(_time(time_of, side, *s), 3) for side in SIDES},
                    "timed": s in timed_set} for s in shapes],
        "ep_loads": "computed from the routing" if p.ep_size > 1 else None,
    }
    if p.ep_size > 1:
        ep_info, ep_steps = measure_ep_step(p, bench, "cuda" if dev.type == "cuda" else "cpu", bench.timing, paddings,
                                    counts, replay_steps, ctx.progress)
        info["ep_step"] = ep_info
        info["headline"]["ep_step"] = ep_headline(ep_info)
        for rec, ep in zip(distinct, ep_steps):
            rec.update(_ep_fields(ep))
    # every step's figures in the record while the trace is short; a long trace keeps its distinct steps, and
    # every step's figures go to the run's step file (columns indexed by step)
    if trace.num_steps <= STEP_RECORDS_MAX:
        info["trace_steps"] = [{"step": i, **distinct[j]} for i, j in enumerate(index.tolist())]
    else:
        info["trace_steps"] = None
        info["distinct_step_records"] = [{"count": c, **rec} for rec, c in zip(distinct, counts)]
    if ctx.run_dir is not None and ctx.rank == 0:
        info["step_file"] = write_step_columns(ctx.run_dir, Point(0, "serving_trace.layer", p).key,
                                               step_columns(distinct, index, serving.dp_size), STEP_FILE_META)
    if serving.trace_replay:
        info["replay"] = _replay_check(bench, replay_steps, time_of)
    info["trace_wall_s"] = round(time.perf_counter() - t0, 3)

    busiest = calls.most_common(1)[0][0] if calls else shapes[0] if shapes else (1, 1)
    sp, batch = bench.batch(*busiest)
    pipe = bench.pipeline(sp, batch, "masked")
    info["run_shape"] = {"rows": busiest[0], "real": busiest[1], "side": "masked"}
    ids = pipe.router_reference().ids.to(torch.int64)
    local = (ids >= 0) & (ids < p.local_experts)
    flops, bytes_moved = expert_work(int(local.sum()), int(torch.unique(ids[local]).numel()),
                                     int(local.any(dim=1).sum()), p.hidden, p.intermediate)
    most_padded = max(shapes, key=lambda s: (s[0] - s[1], s[0])) if shapes else busiest

    def check() -> CheckResult:
        # every distinct step is what the tensor producers make of its real tokens, the composition reads back
        # every timed shape as measured, and the most padded shape's layers are right
        problems = []
        for step in paddings:
            why = padding_problem(step, engine)
            if why:
                problems.append(why)
        for side, rows, real in table:
            got = _time(time_of, side, rows, real)
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
