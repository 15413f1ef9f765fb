"""One EP rank's expert work in an EP step as a cost model fitted to timed workloads, and the plan that decides
which workloads are timed (moebench.bench.serving_trace.rank_timing times them).

A rank's workload after dispatch is `Workload(rows, counts)`: the rows it received (each has at least one route to
its experts) and the routes to each of its local experts. The expert kernel's launch config depends on the rows
(the tuned table's bucket of next_pow2(rows), else the rule's rows per expert), and with it BLOCK_M, so the model
follows the kernel: per launch config (`Launch`: the config the kernel picks at those rows on this device),

    time = coef . (1, experts touched, row tiles, routes, rows),  coef >= 0 (non-negative least squares)

with row tiles counted at that config's BLOCK_M (a paired config's full tiles of two blocks plus an odd last
one): weight reads scale with the experts touched, the GEMM issue with the row tiles, staging and the sum with the
routes and rows. A model fitted across configs, or with a fixed tile size, misreads every workload whose config
differs (that was a 5-6% miss on an H100).

The plan (`plan_rank_times`). An EP step's expert time is, per micro-batch, the slowest rank's (`Contest`: the
ranks of one micro-batch and side, and how many steps it stands for). When the trace's distinct workloads fit the
budget they are all timed (`rank_times: timed`). Otherwise (`rank_times: model`):
  1. design: per launch config, the corners (most and fewest routes, rows, experts touched, row tiles) and an
     even spread of its workloads by routes, at least MIN_PER_LAUNCH each, about a third of the budget in all;
     the fit's own error is its k-fold cross-validation (every design point predicted by a fit without it);
  2. decide: with the model, every contest's candidates for the slowest rank (predicted within twice the model's
     error of the slowest) are ranked by the time they decide (steps x the contest's time, shared among its
     candidates); they are timed in that order, in rounds, until the budget is spent or every candidate is. Each
     round is predicted before it is timed: those predictions are the model's held-out error, on exactly the
     workloads the answer reads; the model is then refitted with them. Timed workloads are read as timed.
The record (`info.ep_step.cost_model`) keeps per launch its coefficients, design points and cross-validated error,
the held-out error over all rounds, and the share of the step's expert time decided by timed workloads (the rest
is the model's, within its held-out error).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.launch import Launch, launches_of, row_tiles
from moebench.bench.serving_trace.record import RankPlan
from moebench.bench.serving_trace.plan import (DESIGN_SHARE, cross_validated, designed_set, error_summary,
                                              fit_relative, run_plan)

FEATURES = ("launch", "experts_touched", "row_tiles", "routes", "rows")


@dataclass(frozen=True)
class Workload:
    """What one EP rank computes: `rows` received rows, `counts[e]` routes to its local expert e."""

    rows: int
    counts: tuple[int, ...]

    @property
    def routes(self) -> int:
        return sum(self.counts)

    def problem(self, top_k: int) -> str | None:
        """Why no routing has these figures, or None: each row has 1..top_k routes, an expert at most one a row."""
        if self.rows < 0 or min(self.counts, default=0) < 0:
            return f"negative rows or counts: {self.rows}, {min(self.counts)}"
        if self.rows == 0:
            return None if self.routes == 0 else f"{self.routes} routes to no rows"
        if not self.rows <= self.routes <= self.rows * top_k:
            return f"{self.routes} routes over {self.rows} rows at top_k {top_k}"
        if max(self.counts) > self.rows:
            return f"an expert with {max(self.counts)} routes from {self.rows} rows"
        return None


def workload_ids(w: Workload, top_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [rows, top_k] local expert ids with exactly w.counts routes per expert over w.rows rows (-1: no route).

    Routes in expert order, route j on row j % rows, slot j // rows: an expert's routes are a run of at most `rows`
    consecutive routes, so they land on distinct rows, and every row gets one since routes >= rows."""
    why = w.problem(top_k)
    if why:
        raise ValueError(f"workload: {why}")
    ids = torch.full((w.rows, top_k), -1, dtype=torch.int32)
    if w.rows:
        experts = torch.repeat_interleave(torch.arange(len(w.counts), dtype=torch.int32),
                                          torch.tensor(w.counts, dtype=torch.int64))
        j = torch.arange(experts.numel())
        ids[j % w.rows, j // w.rows] = experts
    return ids.to(device)


def feature_rows(counts: np.ndarray, rows: np.ndarray, block_m: np.ndarray, paired: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
    """FEATURES of N workloads, one array [N] a feature: counts int [N, E], rows int [N], their launches' BLOCK_M
    and pairing [N]."""
    counts, rows = np.asarray(counts, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    return ((rows > 0).astype(np.float64), (counts > 0).sum(axis=1), row_tiles(counts, block_m, paired),
            counts.sum(axis=1), rows)


def features(w: Workload, launch: Launch) -> list[float]:
    """The cost model's features of one workload under its launch (FEATURES)."""
    got = feature_rows(np.asarray([w.counts], dtype=np.int64).reshape(1, -1), np.asarray([w.rows]),
                       np.asarray([launch.block_m]), np.asarray([launch.paired]))
    return [float(f[0]) for f in got]


@dataclass
class RankCostModel:
    """Per launch config, coefficients over FEATURES (microseconds per unit), fitted to timed workloads."""

    launch_of: Callable[[int], Launch]
    coef: dict[str, list[float]] = field(default_factory=dict)
    points: dict[str, int] = field(default_factory=dict)
    cv_rel: dict[str, list[float]] = field(default_factory=dict)  # per launch: k-fold relative errors
    fallback: list[float] = field(default_factory=list)  # all launches together, for a launch with no fit

    @classmethod
    def fit(cls, launch_of: Callable[[int], Launch], timed: dict[Workload, float]) -> "RankCostModel":
        by_launch: dict[str, list[tuple[list[float], float]]] = {}
        every = []
        for w, t in sorted(timed.items(), key=lambda kv: (kv[0].routes, kv[0].rows, kv[0].counts)):
            if w.rows and t > 0:
                launch = launch_of(w.rows)
                pt = (features(w, launch), t)
                by_launch.setdefault(launch.name, []).append(pt)
                every.append(pt)
        if not every:
            raise ValueError("RankCostModel.fit: no workload with rows to fit to")
        model = cls(launch_of, fallback=fit_relative(every))
        for name, pts in by_launch.items():
            model.points[name] = len(pts)
            if len(pts) >= len(FEATURES):
                model.coef[name] = fit_relative(pts)
            model.cv_rel[name] = cross_validated(pts)
        return model

    def predict(self, w: Workload) -> float:
        if not w.rows:
            return 0.0
        launch = self.launch_of(w.rows)
        coef = self.coef.get(launch.name, self.fallback)
        return sum(c * f for c, f in zip(coef, features(w, launch)))

    __call__ = predict

    def batch(self, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """predict() of many workloads at once: counts int [N, E], rows int [N] -> float64 [N] (the launches looked
        up per distinct row count: launches_of)."""
        counts, rows = np.asarray(counts), np.asarray(rows)
        distinct, at = np.unique(rows, return_inverse=True)
        launches = launches_of(self.launch_of, distinct.tolist())
        names = sorted({lo.name for lo in launches})
        which = np.asarray([names.index(lo.name) for lo in launches], dtype=np.int64)[at]
        f = feature_rows(counts, rows, np.array([lo.block_m for lo in launches], dtype=np.int64)[at],
                         np.array([lo.paired for lo in launches], dtype=bool)[at])
        coef = np.array([self.coef.get(n, self.fallback) for n in names], dtype=np.float64).reshape(len(names), -1)
        t = np.zeros(len(rows))
        for j, feature in enumerate(f):  # summed feature by feature, as predict() sums its terms
            t = t + feature * coef[which, j] if j else feature * coef[which, j]
        return t * (rows > 0)

    def record(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "per_launch": {
            name: {"coef_us": [round(c, 6) for c in self.coef[name]] if name in self.coef else None,
                   "points": self.points[name], "cross_validated": error_summary(self.cv_rel[name])}
            for name in sorted(self.points)}}


class RankTimes:
    """A rank's time: timed where it was timed, else the model's (no model: every workload must be timed).
    `batch_array(counts, rows)` reads many workloads at once (the model vectorised, the timed ones looked up by a
    hash of their figures)."""

    def __init__(self, timed: dict[Workload, float], model: RankCostModel | None = None):
        self.timed, self.model = timed, model

    def __call__(self, w: Workload) -> float:
        if not w.rows:
            return 0.0
        got = self.timed.get(w)
        if got is None:
            if self.model is None:
                raise KeyError(f"rank workload {w} was not timed")
            got = self.model(w)
        return got

    def batch(self, counts: np.ndarray, rows: np.ndarray) -> list[float]:
        return self.batch_array(counts, rows).tolist()

    def batch_array(self, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Many workloads at once: counts int [N, E], rows int [N] -> float64 [N]; a timed workload is found by a
        hash of its figures, then compared whole."""
        counts, rows = np.asarray(counts, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        out = self.model.batch(counts, rows) if self.model is not None else np.zeros(len(rows))
        out = np.asarray(out, dtype=np.float64).copy()
        timed = np.zeros(len(rows), dtype=bool)
        if self.timed and len(rows):
            keys = _workload_hash(counts, rows)
            table = {}
            for w, t in self.timed.items():
                if len(w.counts) == counts.shape[1]:
                    k = int(_workload_hash(np.asarray([w.counts], dtype=np.int64), np.asarray([w.rows]))[0])
                    table.setdefault(k, []).append((w, t))
            candidates = np.flatnonzero(np.isin(keys, np.fromiter(table, dtype=np.uint64, count=len(table))))
            for i in candidates.tolist():
                for w, t in table[int(keys[i])]:
                    if w.rows == rows[i] and np.array_equal(w.counts, counts[i]):
                        out[i], timed[i] = t, True
        if self.model is None:
            missing = np.flatnonzero(~timed & (rows > 0))
            if len(missing):
                i = int(missing[0])
                raise KeyError(f"rank workload ({int(rows[i])} rows, {counts[i].tolist()}) was not timed")
        return np.where(rows > 0, out, 0.0)


def _workload_hash(counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """uint64 [N]: a hash of each workload's rows and counts (equal workloads, equal hashes)."""
    with np.errstate(over="ignore"):
        h = rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for e in range(counts.shape[1]):
            h = (h ^ counts[:, e].astype(np.uint64)) * np.uint64(0x100000001B3) + np.uint64(e + 1)
    return h


@dataclass(frozen=True)
class Contest:
    """The ranks of one micro-batch and side, whose slowest decides its expert time; `steps`: how many of the
    trace's steps it stands for."""

    steps: int
    workloads: tuple[Workload, ...]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(counts int64 [R, E], rows int64 [R]) of its ranks, made once."""
        got = self.__dict__.get("_arrays")
        if got is None:
            got = (np.asarray([w.counts for w in self.workloads], dtype=np.int64).reshape(len(self.workloads), -1),
                   np.asarray([w.rows for w in self.workloads], dtype=np.int64))
            object.__setattr__(self, "_arrays", got)
        return got


def design_sample(workloads: Sequence[Workload], target: int, launch_of: Callable[[int], Launch],
                  limit: int | None = None) -> list[Workload]:
    """About `target` workloads (never more than `limit`) to time for the fit: per launch config its corners (most
    and fewest routes, rows, experts touched, row tiles), then an even spread by routes (designed_set)."""
    groups: dict[str, list[Workload]] = {}
    for w in workloads:
        if w.rows:
            groups.setdefault(launch_of(w.rows).name, []).append(w)

    def corners(group: list[Workload]) -> list[Callable[[Workload], Any]]:
        launch = launch_of(group[0].rows)
        return [lambda w: w.routes, lambda w: w.rows, lambda w: features(w, launch)[1],
                lambda w: features(w, launch)[2]]
    for group in groups.values():
        group.sort(key=lambda w: (w.routes, w.rows, w.counts))
    return designed_set(groups, corners, target, limit)


def decisive_order(contests: Sequence[Contest], model: Callable[[Workload], float], error: float,
                   timed: dict[Workload, float]) -> list[Workload]:
    """Untimed workloads that may be their contest's slowest rank (read as timed where timed, else predicted within
    2 x error of the slowest), most decisive first: each contest's steps x its slowest time, shared among its
    untimed candidates, summed over the contests a workload is a candidate in."""
    worth: dict[Workload, float] = {}
    read = RankTimes(timed, model) if isinstance(model, RankCostModel) else None
    for c in contests:
        times = (read.batch(*c.arrays()) if read is not None
                 else [timed[w] if w in timed else model(w) for w in c.workloads])
        top = max(times, default=0.0)
        if top <= 0:
            continue
        floor = top * (1 - 2 * error)
        open_ = {w for w, t in zip(c.workloads, times) if t >= floor and w.rows and w not in timed}
        for w in open_:
            worth[w] = worth.get(w, 0.0) + c.steps * top / len(open_)
    return sorted(worth, key=lambda w: (-worth[w], -w.routes, -w.rows, w.counts))


def decided_share(contests: Sequence[Contest], lookup: Callable[[Workload], float], timed: dict[Workload, float],
                  error: float) -> float | None:
    """Of the contests' expert time (steps x slowest), the share whose every slowest-rank candidate is timed."""
    total = decided = 0.0
    for c in contests:
        times = lookup.batch(*c.arrays()) if hasattr(lookup, "batch") else [lookup(w) for w in c.workloads]
        top = max(times, default=0.0)
        if top <= 0:
            continue
        floor = top * (1 - 2 * error)
        total += c.steps * top
        if all(w in timed for w, t in zip(c.workloads, times) if t >= floor and w.rows):
            decided += c.steps * top
    return decided / total if total else None


class _RankSide:
    """The rank workloads as plan.run_plan's side: timed one by one, decisive by the contests for the slowest rank
    (decisive_order, within twice the model's error: the cross-validated one until rounds give a held-out one)."""

    def __init__(self, contests, timer, launch_of, untimeable, progress, budget):
        self.contests, self.timer, self.launch_of = contests, timer, launch_of
        self.untimeable, self.progress, self.budget = untimeable, progress, budget
        self.timings, self.cv = 0, None

    def time(self, points):
        out = {}
        for w in points:
            self.progress(self.timings, self.budget)
            out[w] = self.timer(w)
            self.timings += 1
        return out

    def fit(self, timed):
        model = RankCostModel.fit(self.launch_of, timed)
        if self.cv is None:  # the design's fit: its cross-validated error
            self.cv = [r for rels in model.cv_rel.values() for r in rels]
        return model

    def predict(self, model, points):
        return {w: ("", model(w)) for w in points}

    def error(self, held_out) -> float:
        rel = held_out.get("") or self.cv or []
        return max(0.01, error_summary(rel)["rms_rel"] or 0.0)

    def next_round(self, model, timed, held_out, done):
        return [w for w in decisive_order(self.contests, model, self.error(held_out), timed)
                if w not in self.untimeable]


def plan_rank_times(contests: Sequence[Contest], timer: Callable[[Workload], float], budget: int,
                    launch_of: Callable[[int], Launch], tolerance: float, complete: bool = True,
                    progress: Callable[[int, int], None] | None = None, rows_max: int | None = None
                    ) -> tuple[Callable[[Workload], float], RankPlan]:
    """(rank time lookup, its record) for the contests' workloads (see the module docstring). `complete`: the
    contests are all of the trace's (else a model is fitted whatever their count: the steps not read need it);
    `rows_max`: no workload of more rows is timed (the model reads them, extrapolated; the record says so)."""
    t0 = time.perf_counter()
    progress = progress or (lambda done, total: None)
    busy = sorted({w for c in contests for w in c.workloads if w.rows}, key=lambda w: (w.routes, w.rows, w.counts))
    timeable = [w for w in busy if rows_max is None or w.rows <= rows_max] or busy[:1]
    if complete and len(busy) <= budget and len(timeable) == len(busy):
        timed = _RankSide(contests, timer, launch_of, set(), progress, len(busy)).time(busy)
        return RankTimes(dict(timed)), RankPlan("timed", len(busy), len(busy), round(time.perf_counter() - t0, 3))
    untimeable = {w for w in busy if rows_max is not None and w.rows > rows_max}
    side = _RankSide(contests, timer, launch_of, untimeable, progress, budget)
    design = design_sample(timeable, budget // DESIGN_SHARE, launch_of, limit=budget)
    plan = run_plan(side, design, budget)
    lookup = RankTimes(plan.timed, plan.model)
    held = error_summary(plan.held_out.get("", []))
    info = RankPlan(
        "model", len(busy), len(plan.timed), 0.0, design_timings=len(design),
        decisive_timings=len(plan.timed) - len(design), decisive_rounds=plan.rounds,
        cost_model={**plan.model.record(), "cross_validated": error_summary(side.cv or []), "held_out": held,
                    "tolerance": tolerance,
                    "within_tolerance": held["rms_rel"] is not None and held["rms_rel"] <= tolerance},
        decided_by_timing_share=decided_share(contests, lookup, plan.timed, side.error(plan.held_out)),
        timed_rows_max=rows_max, untimeable_workloads=len(untimeable))
    info.wall_s = round(time.perf_counter() - t0, 3)
    return lookup, info
