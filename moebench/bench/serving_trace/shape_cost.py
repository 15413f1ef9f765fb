"""The single-rank view's layer time of every shape of a trace: a designed set timed, the rest read off a cost
model fitted to them, with the model's error on shapes it was not fitted to.

A shape (rows, real) costs the layer on this rank: the router over every row, the alignment and the expert GEMMs
over this rank's local routes (masked: the real rows' alone; oblivious: the padded rows' too), the sum. Its launch
config is the one the layer picks for `rows` rows (launch.launch_of), so per side and launch config

    time = coef . (1, rows, real, local routes, local experts touched, row tiles),  coef >= 0

with the features exact for every shape (shape_streams: prefix sums of two routed streams, no batch per shape).

The plan (`plan_shape_times`, through plan.run_plan): when the trace's distinct shapes fit the budget they are
all timed (`exact`); otherwise (`model`):
  1. design: per launch config the corners (fewest and most rows and real tokens) and an even spread over
     (rows, real), at least plan.MIN_PER_LAUNCH each, about a third of the budget; the fit's k-fold
     error is recorded;
  2. weight: the rest of the budget goes, in rounds, to the untimed shapes that weigh most in the trace (the calls
     that read them x their predicted time). Each round is predicted before it is timed: the model's held-out
     error per side, on the shapes that decide the total; the model is refitted after each round.
A call is read as its real tokens alone plus what its padding adds: time(rows, real) = T(real, real) + d with T
timed where timed, else the model's, and d the timed difference where both shapes are timed, else the model's
(model(rows, real) - model(real, real)): the padding's part is never a measurement minus a model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moebench.bench.serving_trace.launch import Launch, launches_of, row_tiles
from moebench.bench.serving_trace.plan import (DESIGN_SHARE, cross_validated, designed_set, error_summary,
                                              fit_relative, run_plan)
from moebench.bench.serving_trace.record import SIDES, ShapePlan
from moebench.bench.serving_trace.shape_streams import ShapeStreams

FEATURES = ("launch", "rows", "real", "routes", "experts_touched", "row_tiles")
ROUND = 24  # shapes timed between refits (each both sides: two timings)
Shape = tuple[int, int]


class ShapeTable:
    """FEATURES of every shape of a list, per side (arrays over the shapes), and each shape's launch."""

    def __init__(self, shapes: Sequence[Shape], streams: ShapeStreams, launch_of: Callable[[int], Launch]):
        self.shapes = list(shapes)
        self.index = {s: i for i, s in enumerate(self.shapes)}
        rows = np.array([s[0] for s in self.shapes], dtype=np.int64)
        real = np.array([s[1] for s in self.shapes], dtype=np.int64)
        distinct = np.unique(rows).tolist()
        launches = dict(zip(distinct, launches_of(launch_of, distinct)))
        self.launch = [launches[r].name for r in rows.tolist()]
        self.launch_names = sorted(set(self.launch))
        self.launch_id = np.asarray([self.launch_names.index(n) for n in self.launch], dtype=np.int64)
        block = np.array([launches[r].block_m for r in rows.tolist()], dtype=np.int64)
        paired = np.array([launches[r].paired for r in rows.tolist()], dtype=bool)
        self.features: dict[str, np.ndarray] = {}
        for side in SIDES:
            counts = streams.counts("local_counts", rows, real, side) if len(rows) else np.zeros((0, 1), np.int64)
            tiles = row_tiles(counts, block, paired)
            self.features[side] = np.stack([np.ones(len(rows)), rows, real, counts.sum(axis=1),
                                            (counts > 0).sum(axis=1), tiles], axis=1).astype(np.float64)

    def of(self, side: str, shape: Shape) -> list[float]:
        return self.features[side][self.index[shape]].tolist()


@dataclass
class ShapeCostModel:
    """Per side and launch config, coefficients over FEATURES (microseconds per unit)."""

    table: ShapeTable
    coef: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    points: dict[tuple[str, str], int] = field(default_factory=dict)
    cv_rel: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    fallback: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def fit(cls, table: ShapeTable, timed: Mapping[tuple[str, int, int], float]) -> "ShapeCostModel":
        model = cls(table)
        for side in SIDES:
            groups: dict[str, list[tuple[list[float], float]]] = {}
            for (s, rows, real), t in sorted(timed.items()):
                if s == side and t > 0:
                    groups.setdefault(table.launch[table.index[(rows, real)]], []).append(
                        (table.of(side, (rows, real)), t))
            every = [pt for pts in groups.values() for pt in pts]
            if not every:
                raise ValueError("ShapeCostModel.fit: no timed shape")
            model.fallback[side] = fit_relative(every)
            for name, pts in groups.items():
                model.points[(side, name)] = len(pts)
                if len(pts) >= len(FEATURES):
                    model.coef[(side, name)] = fit_relative(pts)
                model.cv_rel[(side, name)] = cross_validated(pts)
        return model

    def predict(self, side: str, rows: int, real: int) -> float:
        return float(self.predict_many(side, [(rows, real)])[0])

    def predict_many(self, side: str, shapes: Sequence[Shape]) -> np.ndarray:
        """predict() of many shapes at once: float64 [N], the terms summed feature by feature."""
        idx = np.asarray([self.table.index[s] for s in shapes], dtype=np.int64)
        names = self.table.launch_names
        which = self.table.launch_id[idx]
        coef = np.asarray([self.coef.get((side, n), self.fallback[side]) for n in names],
                          dtype=np.float64).reshape(len(names), -1)
        f = self.table.features[side][idx]
        t = f[:, 0] * coef[which, 0]
        for j in range(1, f.shape[1]):
            t = t + f[:, j] * coef[which, j]
        return t

    def record(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "per_launch": {
            f"{side} {name}": {"coef_us": [round(c, 6) for c in self.coef[(side, name)]]
                               if (side, name) in self.coef else None, "points": n,
                               "cross_validated": error_summary(self.cv_rel[(side, name)])}
            for (side, name), n in sorted(self.points.items())}}


def design_shapes(shapes: Sequence[Shape], table: ShapeTable, target: int, limit: int) -> list[Shape]:
    """About `target` shapes (at most `limit`): per launch its corners (fewest and most rows, real tokens and
    padded rows) and an even spread over (rows, real) (plan.designed_set)."""
    groups: dict[str, list[Shape]] = {}
    for s in sorted(shapes):
        groups.setdefault(table.launch[table.index[s]], []).append(s)
    corners = [lambda s: (s[0], s[1]), lambda s: (s[1], s[0]), lambda s: (s[0] - s[1], s[0])]
    return designed_set(groups, lambda group: corners, target, limit)


class _ShapeSide:
    """The shapes as plan.run_plan's side: both sides of a shape timed at once; decisive by the calls that read a
    shape times its predicted time (its share of the trace's time)."""

    def __init__(self, table: ShapeTable, reads: Mapping[Shape, int], timeable: Sequence[Shape], time_shapes):
        self.table, self.reads, self.timeable, self.time = table, reads, timeable, time_shapes

    def fit(self, timed):
        return ShapeCostModel.fit(self.table, timed)

    def predict(self, model, points):
        return {(side, *s): (side, model.predict(side, *s)) for s in points for side in SIDES}

    def next_round(self, model, timed, held_out, done):
        todo = [s for s in self.timeable if s not in done]
        if not todo:
            return []
        both = model.predict_many(SIDES[0], todo) + model.predict_many(SIDES[1], todo)  # read at once
        worth = {s: self.reads.get(s, 0) * t for s, t in zip(todo, both.tolist())}
        return sorted((s for s in worth if worth[s] > 0), key=lambda s: (-worth[s], s))


def plan_shape_times(shapes: Sequence[Shape], reads: Mapping[Shape, int], table: ShapeTable,
                     time_shapes: Callable[[Sequence[Shape]], Mapping[tuple[str, int, int], float]], budget: int,
                     tolerance: float, rows_max: int | None = None
                     ) -> tuple[Callable[[str, int, int], float], ShapePlan, dict]:
    """(time_of(side, rows, real), its record, the timed table {(side, rows, real): us}). `reads[s]`: the calls of
    the trace that read shape s (as their own shape or as their real tokens alone); `time_shapes(list)` times
    shapes (both sides) and returns their table entries; `rows_max`: no shape of more rows is timed (the model
    reads them, extrapolated; the record says so)."""
    t0 = time.perf_counter()
    shapes = sorted(set(shapes))
    timeable = [s for s in shapes if rows_max is None or s[0] <= rows_max] or shapes[:1]
    if len(shapes) <= budget and len(timeable) == len(shapes):
        timed = dict(time_shapes(shapes))
        return (lambda side, rows, real: timed[(side, rows, real)]), ShapePlan(
            "exact", len(shapes), len(shapes), wall_s=round(time.perf_counter() - t0, 3)), timed
    design = design_shapes(timeable, table, budget // DESIGN_SHARE, budget)
    plan = run_plan(_ShapeSide(table, reads, timeable, time_shapes), design, budget, ROUND)
    timed, model, done = plan.timed, plan.model, plan.done

    def either(side: str, rows: int, real: int) -> float:
        got = timed.get((side, rows, real))
        return got if got is not None else model.predict(side, rows, real)

    def time_of(side: str, rows: int, real: int) -> float:
        base = either(side, real, real) if real else 0.0
        if rows == real:
            return base
        if (side, rows, real) in timed and (not real or (side, real, real) in timed):
            return timed[(side, rows, real)]
        return base + model.predict(side, rows, real) - (model.predict(side, real, real) if real else 0.0)

    def many(side: str, shapes: Sequence[Shape]) -> np.ndarray:
        """time_of of many shapes (the model read once for all of them)."""
        shapes = list(shapes)
        alone = sorted({(q, q) for _, q in shapes if q})
        at = dict(zip(alone, model.predict_many(side, alone).tolist())) if alone else {}
        padded = [s for s in shapes if s[0] != s[1]]
        own = dict(zip(padded, model.predict_many(side, padded).tolist())) if padded else {}
        out = np.empty(len(shapes))
        for i, (rows, real) in enumerate(shapes):
            base = (timed.get((side, real, real), at[(real, real)]) if real else 0.0)
            if rows == real:
                out[i] = base
            elif (side, rows, real) in timed and (not real or (side, real, real) in timed):
                out[i] = timed[(side, rows, real)]
            else:
                out[i] = base + own[(rows, real)] - (at[(real, real)] if real else 0.0)
        return out

    time_of.many = many  # type: ignore[attr-defined]

    read = list(reads)
    weights = np.asarray([reads[s] for s in read], dtype=np.float64)
    total = 0.0
    for side in SIDES:  # every read shape's time: timed, else the model's (read at once)
        modelled = model.predict_many(side, read) if read else np.zeros(0)
        got = np.asarray([timed.get((side, *s), m) for s, m in zip(read, modelled.tolist())])
        total += float((weights * got).sum()) if read else 0.0
    timed_part = sum(n * sum(timed[(side, *s)] for side in SIDES) for s, n in reads.items() if s in done)
    held_out = {side: error_summary(plan.held_out.get(side, [])) for side in SIDES}
    info = ShapePlan(
        "model", len(shapes), len(done), design_timings=len(design), weighted_timings=len(done) - len(design),
        cost_model={**model.record(), "held_out": held_out, "tolerance": tolerance,
                    "within_tolerance": all(h["rms_rel"] is not None and h["rms_rel"] <= tolerance
                                            for h in held_out.values())},
        timed_share=round(timed_part / total, 5) if total else None, timed_rows_max=rows_max,
        untimeable_shapes=len(shapes) - len(set(timeable)), wall_s=round(time.perf_counter() - t0, 3))
    return time_of, info, timed


def shape_reads(calls: Mapping[Shape, int]) -> dict[Shape, int]:
    """The calls that read each shape: a call (rows, real) reads its own shape and, when padded with real tokens,
    its real tokens alone (real, real)."""
    reads: dict[Shape, int] = {}
    for (rows, real), n in calls.items():
        reads[(rows, real)] = reads.get((rows, real), 0) + n
        if real and rows != real:
            reads[(real, real)] = reads.get((real, real), 0) + n
    return reads


def model_spread_us(time_of: Callable[[str, int, int], float], plan: ShapePlan, side: str, rows: int,
                    real: int) -> float | None:
    """The error to carry for a shape the model read: its held-out RMS share of the time (None: no estimate)."""
    rms = plan.held_out_rms(side)
    return None if rms is None else rms * time_of(side, rows, real)

