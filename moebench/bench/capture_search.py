"""`serving_trace.capture_search`: the cheapest CUDA-graph capture list of at most K sizes for a serving trace, per
side (masked and oblivious), priced by the padding tax's own shapes and model.

Keys (CaptureSearchKnobs, beside serving_trace's: the model, DP / SP / DBO / EP, the fill, the trace):
  capture_graphs   the budgets K (an int, or a list: one point answers each; an axis over ints gives a point each)
  capture_largest  a fixed largest size (a candidate: a size some step pads to), None: the search picks it
  capture_keep     sizes that must stay in the list (e.g. the engine's largest decode batch)
The point prices every shape any candidate list reads (bench.serving_trace.capture_pricing), runs the exact search
(moebench.traces.capture_search) per side, and composes each chosen list and each named list
(moebench.traces.capture_lists) with serving_trace's own compose, so `padding_tax` on a chosen list reproduces its
layer_us. The record (`info.capture_search`) keeps what was priced, per side, so the search re-runs without
moebench; report/capture_search.py reads it for the operator.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from moebench.bench.serving_trace import SHAPE_TIMING
from moebench.bench.serving_trace import build as serving_build  # noqa: F401  (registers serving_trace.layer first)
from moebench.bench.serving_trace.capture_ep import not_priced_reason, pairs_of, price_ep
from moebench.bench.serving_trace.capture_pricing import (EAGER_TIMING, Pricer, eager_price, eager_shapes,
                                                          list_figures, model_noise, price_shapes, priced_sides,
                                                          shapes_timed, shapes_to_price)
from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.record import SIDES, PhaseClock
from moebench.bench.serving_trace.shape_streams import stream_size
from moebench.bench.serving_trace.masked_steps import MaskedStepStore, config_key as masked_config_key
from moebench.bench.serving_trace.rank_timing import RankStore
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore, layer_key
from moebench.bench.serving_trace.trace_input import trace_tokens
from moebench.bench.experts import triton_available
import torch

from moebench.check import CheckResult
from moebench.kernels.fused_experts import expert_work
from moebench.measure.cost import INTERP_PROGRAM_S, DeviceRates, PointWork, layer_call_work, layer_programs
from moebench.params import Params, register_knobs
from moebench.registry import Case, RunContext, declare_work, register_impl
from moebench.traces.capture_lists import CAPTURE_LISTS
from moebench.traces.capture_search import (EngineShape, SearchInputError, candidate_sizes, search,
                                            search_input_problem)

PRICED_RECORDED_MAX = 400_000  # numbers of the priced table per record (~4 MB of JSON); past it, said so
ESTIMATE_STEPS = 5_000  # distinct steps the estimate reads the shapes off (an even sample of a longer trace's)
# the host's part, fitted on the project's 2-core CPU (the scenario's command: 919 distinct steps, 19,201 shapes):
# a shape read priced through the timer (both sides; the cost model's reads dominate) and a distinct step composed
# under one list (named and chosen)
HOST_S_PER_READ = 4e-5
HOST_S_PER_LIST_STEP = 2e-4
# the calls an eager shape side costs: its eager samples and warm-up, the graph's warm-up, capture and replays
EAGER_CALLS = sum(t.warmup + t.iters for t in EAGER_TIMING.values()) + 2


@register_knobs
@dataclass(frozen=True)
class CaptureSearchKnobs:
    # the budgets K: an int or a list of ints; None: 1, 2, 4, ... up to the trace's candidate count
    capture_graphs: Union[int, list, None] = None
    capture_largest: Optional[int] = None
    capture_keep: Optional[list] = None

    def budgets(self, candidates: int) -> list[int]:
        if self.capture_graphs is None:
            return [1 << i for i in range(max(candidates, 1).bit_length())]
        return [self.capture_graphs] if isinstance(self.capture_graphs, int) else [int(k) for k in
                                                                                  self.capture_graphs]

    def problem(self, p: Params) -> str | None:
        g = self.capture_graphs
        if g is not None and not (isinstance(g, int) or (isinstance(g, (list, tuple)) and g and all(isinstance(k, int) for k in g))):
            return f"capture_graphs: an int or a non-empty list of ints, got {g!r}"
        for key in ("capture_largest", "capture_keep"):
            if any(v < 1 for v in self.kept() + ([self.capture_largest] if self.capture_largest else [])):
                return f"{key}: sizes must be >= 1"
        return None

    def kept(self) -> list[int]:
        return [int(k) for k in self.capture_keep or ()]


def _engine(p: Params) -> EngineShape:
    s = p.knobs(ServingKnobs)
    return EngineShape(s.dp_size, s.sp_size, s.dbo)


def _validate(p: Params) -> str | None:
    """The serving_trace point's own checks, then the search's: budgets, the fixed and kept sizes against the
    trace's candidates (the trace is read here, before anything runs)."""
    from moebench.bench.serving_trace import point_problem as serving_validate

    why = serving_validate(p)
    if why:
        return why
    if p.knobs(ServingKnobs).trace_real_points:
        return "trace_real_points: the capture search prices by the exact / model mode (leave it 0)"
    k = p.knobs(CaptureSearchKnobs)
    try:
        trace, _ = trace_tokens(p)
        cands = candidate_sizes(trace.table(), _engine(p), k.kept())
    except SearchInputError as e:
        return str(e)
    why = search_input_problem(cands, k.budgets(len(cands)), k.capture_largest, k.kept())
    return why


def _layer_params(p: Params) -> Params:
    """p with the search's keys at their defaults: the shape store keys shapes by the layer point, and padding_tax's
    points (which never set them) must find the shapes this point priced."""
    return dataclasses.replace(p, **{f.name: f.default for f in dataclasses.fields(CaptureSearchKnobs)})


def _plain(figs: dict) -> dict:
    return {side: dict(f) for side, f in figs.items()}  # unrounded: padding_tax reproduces them to the bit


# a point's time before it runs (run/estimate.py): what it times and composes, counted from its trace
def search_work(p: Params, kind: str) -> dict[str, Any]:
    """What one capture-search point does on a device of `kind` ("cuda" or "cpu"), counted from its trace: the
    shapes the search prices at every candidate size, the ones the plan times (`timed`: the design's at the timeable
    shapes' mean rows, the decisive rounds' at the shapes the answer reads most, reads x rows), the real-only shapes
    the eager price is measured at (a GPU), the timer reads the pricing makes and the lists composed."""
    from moebench.bench.serving_trace.plan import DESIGN_SHARE, TIMED_ROWS_MAX

    engine, keep = _engine(p), p.knobs(CaptureSearchKnobs).kept()
    trace, _ = trace_tokens(p)
    steps, counts = trace.table(), trace.counts
    # a long trace's shapes read off an even sample of its distinct steps: they are pairs of a real count and a
    # candidate size, so the sample misses few
    every = -(-len(steps) // ESTIMATE_STEPS)
    shapes, reads = shapes_to_price(steps[::every], counts[::every], engine, list(CAPTURE_LISTS.values()), keep)
    rows_max, budget = TIMED_ROWS_MAX[kind], p.knobs(ServingKnobs).shape_timings(kind)
    timeable = [s for s in shapes if rows_max is None or s[0] <= rows_max] or shapes[:1]
    timed = shapes_timed(shapes, budget, rows_max)
    design = timed if timed == len(shapes) else min(timed, budget // DESIGN_SHARE)
    decisive = sorted(timeable, key=lambda s: (-reads.get(s, 0) * s[0], s))[:timed - design]

    def mean_rows(group: list) -> float:
        return sum(s[0] for s in group) / max(1, len(group))

    budgets = p.knobs(CaptureSearchKnobs).budgets(len(candidate_sizes(steps, engine, keep)))
    ep_virtual = (pairs_of(steps, engine, keep) + (1 + len(CAPTURE_LISTS)) * len(steps)
                  if not_priced_reason(p, steps, engine, keep) is None else 0)
    return {"shapes": len(shapes), "timed": timed, "design": design, "design_rows": mean_rows(timeable),
            "decisive": len(decisive), "decisive_rows": mean_rows(decisive),
            "eager_shapes": eager_shapes(shapes) if kind == "cuda" else [], "run_rows": shapes[0][0],
            "reads": sum(reads.values()), "lists": len(CAPTURE_LISTS) + 2 * len(budgets),
            "distinct_steps": len(steps), "max_real": max(q for _, q in shapes), "ep_virtual_steps": ep_virtual,
            "timeable": timeable}


def search_seconds(p: Params, rates: DeviceRates) -> float:
    """Seconds of one capture-search point on a device of `rates` (search_work): both sides of each timed shape,
    the eager price (the launches counted at one row; on a GPU each eager shape timed eagerly and replayed), the
    check and the timed run, and the host's routing, timer reads and list compositions."""
    from moebench.bench.serving_trace import estimate as st

    work = search_work(p, "cuda" if rates.is_cuda else "cpu")

    def call_s(rows: float) -> float:
        at = dataclasses.replace(p, num_tokens=max(1, round(rows)))
        if rates.kind == "interpreter":
            return layer_programs(at) * INTERP_PROGRAM_S
        return rates.seconds(*layer_call_work(at), 30)

    def sides_s(rows: float, calls: int) -> float:  # both sides' pipelines built and called
        return 2 * (st.SHAPE_BUILD_S[rates.kind] + calls * call_s(rows))

    calls = st.SHAPE_CALLS[rates.kind]
    shapes_s = work["design"] * sides_s(work["design_rows"], calls) + work["decisive"] * sides_s(
        work["decisive_rows"], calls)
    eager_s = sides_s(1, 2) + sum(sides_s(rows, EAGER_CALLS) for rows, _ in work["eager_shapes"])
    own_s = st.RUN_CALLS * call_s(work["run_rows"]) + st.CHECK_CALLS * call_s(1)
    host_s = (st.HOST_S_FIXED + work["shapes"] * st.HOST_S_PER_SHAPE + work["reads"] * HOST_S_PER_READ
              + work["lists"] * work["distinct_steps"] * HOST_S_PER_LIST_STEP
              + 2 * stream_size(work["max_real"]) * st.ROUTE_S_PER_ROW[rates.kind])
    return shapes_s + eager_s + own_s + host_s + _ep_seconds(p, rates, work)


def _ep_seconds(p: Params, rates: DeviceRates, work: dict) -> float:
    """The EP step's pricing (capture_ep): serving_trace's rank timings and host arithmetic over the virtual steps
    (every step at every candidate, eagerly and under each named list), no replay; the calls are the search's
    priced shapes, one per DP rank, SP rank and micro-batch."""
    from moebench.bench.serving_trace import estimate as st
    from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX

    virtual = work["ep_virtual_steps"]
    if not virtual:
        return 0.0
    engine = _engine(p)
    micro_batches = 2 if engine.dbo else 1
    plan = {"distinct_steps": virtual, "micro_batches": micro_batches, "max_real": work["max_real"],
            "calls_per_step": engine.dp_size * engine.sp_size * micro_batches, "rows_max": TIMED_ROWS_MAX}
    mean_rows = max(1, round(work["design_rows"]))  # search_work's timeable shapes, on this device
    return (st.rank_seconds(p, plan, rates, work["timeable"], mean_rows, replay=False)
            + virtual * (st.HOST_S_PER_STEP + p.ep_size * st.HOST_S_PER_RANK_STEP)
            + st.routed_rows(p, plan) * st.ROUTE_S_PER_ROW[rates.kind])


declare_work("serving_trace.capture_search", PointWork(point=search_seconds))


@dataclass
class _Priced:
    """What the point priced: the trace and its engine, the budgets and named lists, the shapes, their bench, store,
    timer and plan, what an eager call costs (capture_pricing.eager_price) and the phases' clock."""

    trace: Any
    source: dict
    engine: EngineShape
    budgets: list[int]
    named: dict
    shapes: list
    bench: ShapeBench
    store: ShapeStore
    time_of: Any
    plan: Any
    eager: dict
    clock: PhaseClock


def _price(p: Params, ctx: RunContext) -> _Priced:
    """Every shape any candidate list reads, timed or modelled (price_shapes), and the eager calls' price."""
    dev, keep = ctx.device, p.knobs(CaptureSearchKnobs).kept()
    kind = "cuda" if dev.type == "cuda" else "cpu"
    clock = PhaseClock()
    with clock.phase("host_composition"):
        trace, source = trace_tokens(p)
        engine = _engine(p)
        budgets = p.knobs(CaptureSearchKnobs).budgets(len(candidate_sizes(trace.table(), engine, keep)))
        named = dict(CAPTURE_LISTS)
        shapes, reads = shapes_to_price(trace.table(), trace.counts, engine, list(named.values()), keep)
    layer_p = _layer_params(p)
    store = ShapeStore.of_run(ctx.run_store)
    with clock.phase("routing"):
        store.streams_for(layer_p, dev, max(r for _, r in shapes), max(max(rows - r for rows, r in shapes), 1))
    bench = ShapeBench(layer_p, dev, SHAPE_TIMING[kind], store.streams)
    time_of, plan = price_shapes(layer_p, dev, bench, shapes, reads, store,
                                 p.knobs(ServingKnobs).trace_shape_timings, ctx.progress, clock)
    with clock.phase("shapes"):
        eager = eager_price(bench, shapes)
    return _Priced(trace, source, engine, budgets, named, shapes, bench, store, time_of, plan, eager, clock)


def _side_records(priced: dict, found: dict, figures, noise: dict) -> dict[str, Any]:
    """Per side what the operator reads (per K the list and its figures, the curve, the bound, the noise) and what
    was searched (the priced table, while it is small enough to record)."""
    sides: dict[str, Any] = {}
    for side in SIDES:
        res, table = found[side], priced[side]
        numbers = len(table.candidates) * (len(table.candidates) + 3) // 2
        per_k = {str(k): {"sizes": list(choice.sizes), "graphs": len(choice.sizes),
                          "searched_us": round(choice.time_us, 3), "figures": figures(choice.sizes)}
                 for k, choice in sorted(res.best.items())}
        small = 2 * numbers <= PRICED_RECORDED_MAX
        sides[side] = {
            "per_k": per_k, "curve_us": [round(v, 3) for v in res.curve],
            "curve_lists": [list(sizes) for sizes in res.curve_lists],
            "lower_bound_us": round(res.lower_bound_us, 3),
            "within_1pct_k": res.within_bound_k, "candidates": res.candidates, "method": res.method,
            "monotone": table.monotone, "noise_rel": noise[side], "priced": table.to_record() if small else None,
            "priced_note": None if small else (
                f"{numbers:,} priced numbers a side, past {PRICED_RECORDED_MAX // 2:,}: not recorded")}
    return sides


def _ep_step_record(p: Params, ctx: RunContext, pr: _Priced, knobs: "CaptureSearchKnobs") -> dict[str, Any]:
    """The search over the EP step (capture_ep): per side the same answer as the layer's, priced by the slowest EP
    rank plus the wire, the named lists' EP figures, the rank plan's model and error; or why it was not priced."""
    keep, steps = knobs.kept(), pr.trace.table()
    why = not_priced_reason(p, steps, pr.engine, keep)
    if why:
        return {"not_priced": why}
    layer_p = _layer_params(p)
    ep = price_ep(layer_p, ctx.device, pr.bench.timing, steps, pr.trace.counts, pr.engine, keep, pr.named,
                  pr.eager["per_call_us"], pr.clock, ctx.progress,
                  RankStore.of_run(ctx.run_store).for_layer(layer_key(layer_p, ctx.device)),
                  MaskedStepStore.of_run(ctx.run_store).for_config(masked_config_key(layer_p, ctx.device)))
    found = {side: search(ep.priced[side], pr.budgets, knobs.capture_largest, keep) for side in SIDES}

    def figures(sizes):
        return {side: ep.chosen_figures(side, sizes) for side in SIDES}

    rec = ep.record
    return {"sides": _side_records(ep.priced, found, figures, {side: ep.noise_rel for side in SIDES}),
            "named": ep.named, "noise_source": ep.noise_source, "pairs": ep.pairs, "virtual_steps": ep.virtual_steps,
            "rank_times": rec.rank_times, "distinct_workloads": rec.distinct_workloads,
            "rank_timings": rec.rank_timings, "cost_model": rec.cost_model, "rank_plan": rec.rank_plan,
            "placement": rec.placement, "wire": rec.wire, "wall_s": rec.wall_s,
            "priced_as": "each distinct step composed as an EP step (slowest rank plus dispatch and combine) at "
                         "every candidate size, eagerly (plus one source's eager launches) and under each named "
                         "list; padded_us[g][j - g] = group g's steps at candidates[j]"}


def _eager_record(eager: dict) -> dict[str, Any]:
    return {**eager, "per_call_us": {s: round(v, 3) for s, v in eager["per_call_us"].items()}}


@register_impl("serving_trace.capture_search", targets=("serving_trace",), available=triton_available,
               validate=_validate,
               description="the cheapest CUDA-graph capture list of at most K sizes for the trace, masked and "
                           "oblivious, priced by the padding tax's shapes and model (exact partition DP)")
def build(p: Params, ctx: RunContext) -> Case:
    t0 = time.perf_counter()
    knobs = p.knobs(CaptureSearchKnobs)
    keep = knobs.kept()
    pr = _price(p, ctx)
    trace, engine, eager_call_us = pr.trace, pr.engine, pr.eager["per_call_us"]
    pricer = Pricer(pr.time_of, engine.sp_size, engine.dbo, eager_call_us)
    t_price = time.perf_counter()
    priced = priced_sides(trace.table(), trace.counts, engine, pricer, keep)
    price_s = time.perf_counter() - t_price
    t_search = time.perf_counter()
    found = {side: search(priced[side], pr.budgets, knobs.capture_largest, keep) for side in SIDES}
    search_s = time.perf_counter() - t_search
    trace_steps, trace_counts = trace.steps, trace.counts.tolist()

    def figures(sizes):
        return _plain(list_figures(trace_steps, trace_counts, engine, sizes, pr.time_of, eager_call_us))

    named_figs = {name: {"graphs": len(sizes), **figures(sizes)} for name, sizes in pr.named.items()}
    sides = _side_records(priced, found, figures, model_noise(pr.plan, pr.store.shapes))
    ep_step = _ep_step_record(p, ctx, pr, knobs)
    info: dict[str, Any] = {
        "trace": {**pr.source, "steps": trace.num_steps, "distinct_steps": len(trace.steps)},
        "engine": {"dp_size": engine.dp_size, "sp_size": engine.sp_size, "dbo": engine.dbo, "ep_size": p.ep_size,
                   "num_local_experts": p.local_experts, "expert_dtype": p.expert_dtype},
        "budgets": pr.budgets, "largest": knobs.capture_largest, "keep": keep,
        "capture_search": {
            "sides": sides, "named": named_figs, "eager": _eager_record(pr.eager), "ep_step": ep_step,
            "priced_as": "each distinct step's DP ranks at every candidate size (cudagraph, then DP max); groups "
                         "of steps sharing their padded candidate: weight = steps, padded_us[g][j - g] = their time "
                         "at candidates[j], eager_us = their time run eagerly",
            "card": torch_card(ctx.device), "pricing_s": round(price_s, 3), "search_s": round(search_s, 3)},
        "shape_plan": pr.plan.to_info(), "distinct_shapes": len(pr.shapes),
        "phase_wall_s": pr.clock.record(), "trace_wall_s": round(time.perf_counter() - t0, 3)}
    return _case(p, pr, sides, info)


def _case(p: Params, pr: _Priced, sides: dict, info: dict) -> Case:
    """The runner's Case: its timed call the masked layer at the smallest priced shape; its check the DP's figures
    against the composed ones and the layers at one row against their references."""
    bench = pr.bench

    def check() -> CheckResult:
        # the DP's figure for every list it chose is what composing the trace under that list gives (two
        # arithmetics over the same timer), and the layer at the smallest shape is right
        problems = []
        views = [("", sides)] + ([("EP step ", ep_sides)] if (ep_sides := info["capture_search"]["ep_step"].get(
            "sides")) else [])
        for view, per_side in views:
            for side in SIDES:
                for k, row in per_side[side]["per_k"].items():
                    got, want = row["searched_us"], row["figures"][side]["time_us"]
                    if abs(got - want) > 1e-6 * max(1.0, abs(want)) + 2e-3:
                        problems.append(f"{view}{side} K={k}: searched {got} us, composed {want} us")
        return CheckResult.merge(CheckResult(not problems, "; ".join(problems[:3]), {}), bench.check_shape(1, 1))

    sp, batch = bench.batch(*pr.shapes[0])
    pipe = bench.pipeline(sp, batch, "masked")
    # what run() must do: the masked layer's experts at that shape (padding_tax's declaration of its run shape)
    ids = pipe.router_reference().ids.to(torch.int64)
    local = (ids >= 0) & (ids < p.local_experts)
    flops, bytes_moved = expert_work(int(local.sum()), int(torch.unique(ids[local]).numel()),
                                     int(local.any(dim=1).sum()), p.hidden, p.intermediate)

    def cleanup() -> None:
        nonlocal pipe
        pipe = None

    return Case(run=lambda: pipe.run(), check=check, info=info, nvtx_stage="layer", cleanup=cleanup, flops=flops,
                bytes_moved=bytes_moved,
                bytes_note="run(): the masked layer at the trace's smallest priced shape")


def torch_card(dev) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
