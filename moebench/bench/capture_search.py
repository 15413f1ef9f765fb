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
from moebench.bench.serving_trace.capture_pricing import (Pricer, eager_price, list_figures, model_noise,
                                                          price_shapes, priced_sides, shapes_to_price)
from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.record import SIDES, PhaseClock
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore
from moebench.bench.serving_trace.trace_input import trace_tokens
from moebench.bench.experts import triton_available
import torch

from moebench.check import CheckResult
from moebench.kernels.fused_experts import expert_work
from moebench.params import Params, register_knobs
from moebench.registry import Case, RunContext, register_impl
from moebench.traces.capture_lists import CAPTURE_LISTS
from moebench.traces.capture_search import (EngineShape, SearchInputError, candidate_sizes, search,
                                            search_input_problem)

PRICED_RECORDED_MAX = 400_000  # numbers of the priced table per record (~4 MB of JSON); past it, said so


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


def _side_records(pr: _Priced, priced: dict, found: dict, figures) -> dict[str, Any]:
    """Per side what the operator reads (per K the list and its composed figures, the curve, the bound, the noise)
    and what was searched (the priced table, while it is small enough to record)."""
    noise = model_noise(pr.plan, pr.store.shapes)
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
            "lower_bound_us": round(res.lower_bound_us, 3),
            "within_1pct_k": res.within_bound_k, "candidates": res.candidates, "method": res.method,
            "monotone": table.monotone, "noise_rel": noise[side], "priced": table.to_record() if small else None,
            "priced_note": None if small else (
                f"{numbers:,} priced numbers a side, past {PRICED_RECORDED_MAX // 2:,}: not recorded")}
    return sides


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
    sides = _side_records(pr, priced, found, figures)
    info: dict[str, Any] = {
        "trace": {**pr.source, "steps": trace.num_steps, "distinct_steps": len(trace.steps)},
        "engine": {"dp_size": engine.dp_size, "sp_size": engine.sp_size, "dbo": engine.dbo, "ep_size": p.ep_size,
                   "num_local_experts": p.local_experts, "expert_dtype": p.expert_dtype},
        "budgets": pr.budgets, "largest": knobs.capture_largest, "keep": keep,
        "capture_search": {
            "sides": sides, "named": named_figs, "eager": _eager_record(pr.eager),
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
        for side in SIDES:
            for k, row in sides[side]["per_k"].items():
                got, want = row["searched_us"], row["figures"][side]["time_us"]
                if abs(got - want) > 1e-6 * max(1.0, abs(want)) + 2e-3:
                    problems.append(f"{side} K={k}: searched {got} us, composed {want} us")
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
