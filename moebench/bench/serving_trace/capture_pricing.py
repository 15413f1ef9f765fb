"""Pricing the capture-list search (moebench.traces.capture_search) by the padding tax's own model: every layer call
a step makes at every candidate size it can pad to is a shape (rows, real), timed or read off the shape cost model
exactly as serving_trace.layer does (shapes.measure_shapes, shape_cost.plan_shape_times: the run's shape store, the
same budget, the same held-out error), masked and oblivious apart.

A step above the largest listed size runs eagerly: its calls at their unpadded rows plus, per layer call, what
an eager call costs over its CUDA-graph replay (`eager_price`). On a GPU that is measured on this layer: one or two
of the trace's real-only shapes timed both ways (CUDA events around host-launched calls, and graph replays), their
difference per call (`measured_eager`). Where graphs do not exist (a CPU) it is docs/hardware.md's empty kernel
(eager launch 4.06 us, CUDA-graph replay 1.08 us, an H200 figure) times the layer's kernel launches, counted on the
layer itself (interpreted Triton launches; torch's own small ops are not counted there). The record says which
(`eager.source`: "measured" with its shapes and figures, or "documented figure").

The figures the operator reads for a list (the chosen ones and the named ones) are composed by serving_trace's own
compose / totals over the same distinct steps with the same timer, so `padding_tax` run in the same run on that
list (its shapes reused from the store) gives the same layer_us to the last bit; the eager launches are added
beside it (`eager_launch_us`), which padding_tax does not price.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.compose import compose, layer_totals
from moebench.bench.serving_trace.launch import launch_of
from moebench.bench.serving_trace.record import SIDES, ShapePlan
from moebench.bench.serving_trace.knobs import DEFAULT_SHAPE_TIMINGS
from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX
from moebench.bench.serving_trace.shape_cost import ShapeTable, plan_shape_times, shape_reads
from moebench.bench.serving_trace.shapes import ShapeBench, ShapeStore, measure_shapes
from moebench.bench.serving_trace.replay import REPLAY_TOLERANCE
from moebench.inputs.engine_padding import Engine, StepPadding, step_padding
from moebench.measure.timing import measure
from moebench.params import Params, Timing
from moebench.traces.capture_search import EngineShape, PricedTrace, list_time, price_trace

# docs/hardware.md, "empty kernel: eager launch / CUDA-graph replay" (H200): a documented figure, not a timing
EAGER_LAUNCH_US, GRAPH_LAUNCH_US = 4.06, 1.08
DOCUMENTED, MEASURED = "documented figure", "measured"
DOCUMENTED_NOTE = ("docs/hardware.md: empty kernel, eager launch 4.06 us vs CUDA-graph replay 1.08 us (H200), per "
                   "kernel launch of the layer; not a timing of this layer")
# the eager-vs-graph timing of one shape side: enough samples for a median, few enough to cost well under a second
EAGER_TIMING = {"eager": Timing(mode="events", warmup=3, iters=20, unroll=1, max_seconds=2.0),
                "graph": Timing(mode="cuda_graph", warmup=3, iters=20, unroll=1, max_seconds=2.0)}
Shape = tuple[int, int]


@lru_cache(maxsize=None)
def rank_calls(real: int, rows: int, sp_size: int, dbo: bool) -> tuple[Shape, ...]:
    """One DP rank's layer calls (rows, real) with `real` tokens in a step of `rows` DP-padded rows: read off
    step_padding itself (a second DP rank holding `rows` real tokens fixes the step's rows; the capture list (1,)
    pads nothing above 1)."""
    step = step_padding([real, rows], Engine((1,), 2, sp_size, dbo))
    return tuple((c.rows, c.real) for c in step.calls if c.dp_rank == 0)


@dataclass
class Pricer:
    """Both sides' rank prices over one timer: price(side)(real, rows) and eager(side)(real, rows)."""

    time_of: Callable[[str, int, int], float]
    sp_size: int
    dbo: bool
    eager_call_us: dict[str, float]  # per layer call run eagerly, per side

    def price(self, side: str) -> Callable[[int, int], float]:
        return lambda real, rows: sum(self.time_of(side, r, q) for r, q in rank_calls(real, rows, self.sp_size,
                                                                                      self.dbo))

    def eager(self, side: str) -> Callable[[int, int], float]:
        def at(real: int, rows: int) -> float:
            calls = rank_calls(real, rows, self.sp_size, self.dbo)
            return sum(self.time_of(side, r, q) for r, q in calls) + len(calls) * self.eager_call_us[side]
        return at


def shapes_to_price(steps: np.ndarray, counts: np.ndarray, engine: EngineShape, lists: Sequence[Sequence[int]],
                    keep: Sequence[int] = ()) -> tuple[list[Shape], dict[Shape, int]]:
    """Every shape the search and the named lists read (each call's (rows, real) and its real tokens alone), and the
    calls that read each (summed over every candidate size and list: what weighs in the answer)."""
    calls: dict[Shape, int] = {}

    def collect(real: int, rows: int) -> float:
        for s in rank_calls(real, rows, engine.sp_size, engine.dbo):
            calls[s] = calls.get(s, 0) + 1
        return 0.0

    price_trace(steps, counts, engine, collect, collect, keep)
    for sizes in lists:
        list_time(steps, counts, sizes, collect, collect)
    reads = shape_reads(calls)
    return sorted(reads), reads


def layer_launches(bench: ShapeBench, side: str) -> int:
    """Kernel launches of one layer call (one real row): CUDA kernels on a GPU, interpreted Triton launches on a CPU."""
    sp, batch = bench.batch(1, 1)
    pipe = bench.pipeline(sp, batch, side)
    if bench.device.type == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        pipe.run()
        torch.cuda.synchronize(bench.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pipe.run()
            torch.cuda.synchronize(bench.device)
        return sum(e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    from moebench.measure.interpreted_launches import counting_interpreted_launches

    with counting_interpreted_launches() as count:
        pipe.run()
    return int(count[0]) if count is not None else 0


def eager_shapes(shapes: Sequence[Shape]) -> list[Shape]:
    """The real-only shapes the eager-over-graph cost is measured at: the trace's largest real count and the one
    nearest half of it (a step runs eagerly above the list's largest size: the trace's larger steps)."""
    reals = sorted({real for _, real in shapes if real > 0}) or [1]
    top = reals[-1]
    half = min(reals, key=lambda q: (abs(2 * q - top), q))
    return [(q, q) for q in sorted({half, top})]


def measured_eager(bench: ShapeBench, shapes: Sequence[Shape]) -> dict[str, Any]:
    """Each side's layer at each shape timed eagerly (CUDA events around host-launched calls) and as a CUDA-graph
    replay (p50 of each), and their difference per call; a GPU only."""
    out: dict[str, Any] = {"shapes": [list(s) for s in shapes], "eager_us": {}, "graph_us": {}, "over_graph_us": {}}
    for side in SIDES:
        for key in ("eager_us", "graph_us", "over_graph_us"):
            out[key][side] = []
        for rows, real in shapes:
            sp, batch = bench.batch(rows, real)
            pipe = bench.pipeline(sp, batch, side)
            got = {how: float(measure(pipe.run, timing, bench.device, graph_capturable=True).stats["p50"])
                   for how, timing in EAGER_TIMING.items()}
            del pipe
            out["eager_us"][side].append(round(got["eager"], 3))
            out["graph_us"][side].append(round(got["graph"], 3))
            out["over_graph_us"][side].append(round(got["eager"] - got["graph"], 3))
    return out


def eager_price(bench: ShapeBench, shapes: Sequence[Shape]) -> dict[str, Any]:
    """What a layer call run eagerly costs over its graph replay, per side, and where the figure comes from: measured
    on this layer on a GPU (the mean difference over eager_shapes, never below 0: a GPU-bound call hides its
    launches), docs/hardware.md's launch figure times the layer's launches where graphs do not exist."""
    launches = {side: layer_launches(bench, side) for side in SIDES}
    if bench.device.type == "cuda":
        got = measured_eager(bench, eager_shapes(shapes))
        per_call = {side: max(0.0, float(np.mean(got["over_graph_us"][side]))) for side in SIDES}
        return {"source": MEASURED, "per_call_us": per_call, "launches_per_call": launches, "measured": got,
                "launches_counted": "CUDA kernels (torch.profiler)"}
    return {"source": DOCUMENTED, "note": DOCUMENTED_NOTE, "launches_per_call": launches,
            "per_call_us": {side: launches[side] * (EAGER_LAUNCH_US - GRAPH_LAUNCH_US) for side in SIDES},
            "launches_counted": "interpreted Triton launches (torch's own ops not counted)"}


def shapes_timed(shapes: Sequence[Shape], budget: int, rows_max: int | None) -> int:
    """How many of `shapes` (distinct) plan_shape_times times: every one while they fit the budget and the device
    times them all, else at most the budget of those it times (the progress line's total)."""
    timeable = sum(1 for rows, _ in shapes if rows_max is None or rows <= rows_max) or min(len(shapes), 1)
    if len(shapes) <= budget and timeable == len(shapes):
        return len(shapes)
    return min(budget, timeable)


def price_shapes(p: Params, dev: torch.device, bench: ShapeBench, shapes: list[Shape], reads: dict[Shape, int],
                 store: ShapeStore, budget: int | None, progress=None, clock=None
                 ) -> tuple[Callable[[str, int, int], float], dict[str, Any]]:
    """The timer over `shapes`, by serving_trace.layer's exact mode / shape cost model (its plan's record)."""
    kind = "cuda" if dev.type == "cuda" else "cpu"
    measure_shapes(p, bench, shapes, [], store, None, clock)
    budget = budget or DEFAULT_SHAPE_TIMINGS[kind]
    total = shapes_timed(shapes, budget, TIMED_ROWS_MAX[kind])  # what the plan times, not every shape it prices
    done = [0]

    def time_shapes(batch):
        base = done[0]
        prog = None if progress is None else (lambda i, _n, what, detail="": progress(base + i, total, what, detail))
        _, got, _ = measure_shapes(p, bench, [], list(batch), store, prog, clock)
        done[0] += len(batch)
        return got

    table = ShapeTable(shapes, store.streams, launch_of(p, dev))
    time_of, plan, _ = plan_shape_times(shapes, reads, table, time_shapes, budget, REPLAY_TOLERANCE,
                                        TIMED_ROWS_MAX[kind])
    return time_of, plan


def model_noise(plan: ShapePlan, figures: dict) -> dict[str, float | None]:
    """Per side, the relative error two lists' times must differ by to be told apart: the model's held-out RMS error
    where shapes were modelled; the timed shapes' median half p10-p90 spread in exact mode (None: one sample a shape,
    no spread)."""
    out: dict[str, float | None] = {}
    for side in SIDES:
        if plan.shape_times == "model":
            out[side] = plan.held_out_rms(side)
            continue
        rel = [f.layer_spread_us[side] / f.layer_us[side] for f in figures.values()
               if f.layer_us.get(side) and f.layer_spread_us.get(side) is not None]
        out[side] = float(np.median(rel)) if rel else None
    return out


def list_figures(trace_steps: Sequence[tuple[int, ...]], counts: Sequence[int], engine: EngineShape,
                 sizes: Sequence[int], time_of: Callable[[str, int, int], float], eager_call_us: dict[str, float]
                 ) -> dict[str, dict[str, float]]:
    """Per side a list's trace figures as padding_tax composes them (compose, totals over the distinct steps in
    order), plus the eager launches of the steps above its largest size: {side: {layer_us, real_only_us,
    padding_us, eager_launch_us, time_us, padding_tax}}."""
    eng = Engine(tuple(sorted(int(s) for s in sizes)) or (1,), engine.dp_size, engine.sp_size, engine.dbo)
    paddings: list[StepPadding] = [step_padding(real, eng) for real in trace_steps]
    tot = layer_totals(compose(paddings, time_of), list(counts))
    largest = max(sizes) if sizes else 0
    eager_calls = sum(n * len(step.calls) for step, n in zip(paddings, counts) if max(step.real) > largest)
    out = {}
    for side in SIDES:
        layer = tot["layer_us"][side]
        eager = eager_calls * eager_call_us[side]
        out[side] = {"layer_us": layer, "real_only_us": tot["real_only_us"][side],
                     "padding_us": tot["padding_us"][side], "eager_launch_us": eager, "time_us": layer + eager,
                     "padding_tax": tot["padding_us"][side] / layer if layer else None, "eager_calls": eager_calls}
    return out


def priced_sides(steps: np.ndarray, counts: np.ndarray, engine: EngineShape, pricer: Pricer, keep=()
                 ) -> dict[str, PricedTrace]:
    return {side: price_trace(steps, counts, engine, pricer.price(side), pricer.eager(side), keep) for side in SIDES}
