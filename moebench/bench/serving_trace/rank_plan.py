"""Which EP rank workloads are timed (`plan_rank_times`), and how the contests for the slowest rank read them.

An EP step's expert time is, per micro-batch, the slowest rank's (`Contest`: the ranks of one micro-batch and side,
and how many steps it stands for). When the trace's distinct workloads fit the budget they are all timed
(`rank_times: timed`). Otherwise (`rank_times: model`; the engine is plan.run_plan, the model rank_cost.py):
  1. design: per launch config, the corners (most and fewest routes, rows, experts touched, row tiles) and an
     even spread of its workloads by routes, at least MIN_PER_LAUNCH each, about a third of the budget in all;
     the fit's own error is its k-fold cross-validation (every design point predicted by a fit without it);
  2. decide: with the model, every contest's candidates for the slowest rank (predicted within twice the model's
     error of the slowest) are ranked by the time they decide (steps x the contest's time, shared among its
     candidates); they are timed in that order, in rounds, until the budget is spent, every candidate is, or the
     plan's seconds have passed. Each round is predicted before it is timed: those predictions are the model's
     held-out error, on exactly the workloads the answer reads; the model is then refitted with them. Timed
     workloads are read as timed, and so are the ones the run timed before at this layer point (`known`).
The record (`info.ep_step.cost_model`) keeps per launch its coefficients, design points and cross-validated error,
the held-out error over all rounds, and the share of the step's expert time decided by timed workloads (the rest
is the model's, within its held-out error).

Every round reads every contest, so the contests are arrays (`ContestTable`: each rank a row, the distinct
workloads found once): a million-step trace reads 10^4 contests of 64 ranks a round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from moebench.bench.serving_trace.launch import Launch
from moebench.bench.serving_trace.plan import DESIGN_SHARE, error_summary, run_plan
from moebench.bench.serving_trace.rank_cost import RankCostModel, RankTimes, Workload, design_sample
from moebench.bench.serving_trace.record import RankPlan


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


class ContestTable:
    """Contests as arrays: every rank of every contest a row (`contest_of`, `starts` of each contest's rows), its
    distinct workload `uid` among `workloads` (with their `rows` and `counts`)."""

    def __init__(self, contests: Sequence[Contest]):
        contests = [c for c in contests if c.workloads]
        sizes = np.asarray([len(c.workloads) for c in contests], dtype=np.int64)
        self.steps = np.asarray([c.steps for c in contests], dtype=np.float64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.contest_of = np.repeat(np.arange(len(contests)), sizes)
        width = contests[0].arrays()[0].shape[1] if contests else 0
        counts = np.concatenate([c.arrays()[0] for c in contests]) if contests else np.zeros((0, width), np.int64)
        rows = np.concatenate([c.arrays()[1] for c in contests]) if contests else np.zeros(0, np.int64)
        distinct, uid = np.unique(np.concatenate([rows[:, None], counts], axis=1), axis=0, return_inverse=True)
        self.uid = uid.reshape(-1)
        self.rows, self.counts = distinct[:, 0], distinct[:, 1:]
        self.workloads = [Workload(r, tuple(c)) for r, c in zip(self.rows.tolist(), self.counts.tolist())]
        self.index = {w: i for i, w in enumerate(self.workloads)}

    @classmethod
    def of(cls, contests: "Sequence[Contest] | ContestTable") -> "ContestTable":
        return contests if isinstance(contests, ContestTable) else cls(contests)

    def is_timed(self, timed: dict[Workload, float]) -> np.ndarray:
        """bool [distinct workloads]: which are in `timed`."""
        got = np.zeros(len(self.workloads), dtype=bool)
        got[[i for w in timed if (i := self.index.get(w)) is not None]] = True
        return got

    def times(self, read: Callable[[Workload], float], timed: dict[Workload, float]) -> np.ndarray:
        """float64 [distinct workloads]: a RankTimes' own reading, else timed where timed and `read`'s elsewhere
        (a RankCostModel read vectorised)."""
        if isinstance(read, RankTimes):
            return read.batch_array(self.counts, self.rows)
        if isinstance(read, RankCostModel):
            return RankTimes(timed, read).batch_array(self.counts, self.rows)
        return np.asarray([timed[w] if w in timed else (read(w) if w.rows else 0.0) for w in self.workloads],
                          dtype=np.float64)

    def candidates(self, times: np.ndarray, error: float) -> tuple[np.ndarray, np.ndarray]:
        """(each contest's slowest time [C], bool [rows]: the ranks within 2 x error of their contest's slowest)."""
        t = times[self.uid]
        top = np.maximum.reduceat(t, self.starts) if len(t) else np.zeros(0)
        live = top > 0
        near = (t >= (top * (1 - 2 * error))[self.contest_of]) & (self.rows[self.uid] > 0) & live[self.contest_of]
        return top, near


def decisive_order(contests: "Sequence[Contest] | ContestTable", model: Callable[[Workload], float], error: float,
                   timed: dict[Workload, float]) -> list[Workload]:
    """Untimed workloads that may be their contest's slowest rank (read as timed where timed, else predicted within
    2 x error of the slowest), most decisive first: each contest's steps x its slowest time, shared among its
    untimed candidates (a workload on two of its ranks counted once), summed over the contests it is a candidate
    in; ties by more routes, more rows, then the counts."""
    table = ContestTable.of(contests)
    top, near = table.candidates(table.times(model, timed), error)
    open_ = near & ~table.is_timed(timed)[table.uid]
    n = len(table.workloads)
    pairs = np.unique(table.contest_of[open_] * n + table.uid[open_])  # by contest, as the contests are met
    contest, uid = pairs // n, pairs % n
    shares = np.bincount(contest, minlength=len(top))
    worth = np.bincount(uid, weights=table.steps[contest] * top[contest] / shares[contest], minlength=n)
    picked = np.unique(uid)
    routes = table.counts[picked].sum(axis=1)
    keys = tuple(table.counts[picked][:, e] for e in range(table.counts.shape[1] - 1, -1, -1))
    order = np.lexsort(keys + (-table.rows[picked], -routes, -worth[picked]))
    return [table.workloads[i] for i in picked[order].tolist()]


def decided_share(contests: "Sequence[Contest] | ContestTable", lookup: Callable[[Workload], float],
                  timed: dict[Workload, float], error: float) -> float | None:
    """Of the contests' expert time (steps x slowest), the share whose every slowest-rank candidate is timed."""
    table = ContestTable.of(contests)
    top, near = table.candidates(table.times(lookup, timed), error)
    untimed = np.bincount(table.contest_of[near & ~table.is_timed(timed)[table.uid]], minlength=len(top))
    weight = table.steps * top * (top > 0)
    total = float(weight.sum())
    return float(weight[untimed == 0].sum()) / total if total else None


class _RankSide:
    """The rank workloads as plan.run_plan's side: timed one by one, decisive by the contests for the slowest rank
    (decisive_order, within twice the model's error: the cross-validated one until rounds give a held-out one)."""

    def __init__(self, table: ContestTable, timer, launch_of, untimeable, progress, budget):
        self.table, self.timer, self.launch_of = table, timer, launch_of
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
        return [w for w in decisive_order(self.table, model, self.error(held_out), timed)
                if w not in self.untimeable]


def plan_rank_times(contests: Sequence[Contest], timer: Callable[[Workload], float], budget: int,
                    launch_of: Callable[[int], Launch], tolerance: float, complete: bool = True,
                    progress: Callable[[int, int], None] | None = None, rows_max: int | None = None, *,
                    known: dict[Workload, float] | None = None, seconds: float | None = None
                    ) -> tuple[RankTimes, RankPlan]:
    """(rank time lookup, its record) for the contests' workloads (see the module docstring). `complete`: the
    contests are all of the trace's (else a model is fitted whatever their count: the steps not read need it);
    `rows_max`: no workload of more rows is timed (the model reads them, extrapolated; the record says so);
    `known`: workloads the run timed before at this layer point (read, fitted, never timed again, not counted in
    `budget`); `seconds`: the decisive rounds stop after this many seconds of planning (the design is timed
    whole)."""
    t0 = time.perf_counter()
    progress = progress or (lambda done, total: None)
    known = known or {}
    table = ContestTable(contests)
    busy_at = np.flatnonzero(table.rows > 0)
    busy_at = busy_at[np.lexsort(tuple(table.counts[busy_at][:, e] for e in range(table.counts.shape[1] - 1, -1, -1))
                                 + (table.rows[busy_at], table.counts[busy_at].sum(axis=1)))]
    busy = [table.workloads[i] for i in busy_at.tolist()]  # by routes, rows, counts
    timeable = [w for w in busy if rows_max is None or w.rows <= rows_max] or busy[:1]
    if complete and len(busy) <= budget and len(timeable) == len(busy):
        new = [w for w in busy if w not in known]
        timed = {w: known[w] for w in busy if w in known}
        timed.update(_RankSide(table, timer, launch_of, set(), progress, len(new)).time(new))
        return RankTimes(timed), RankPlan("timed", len(busy), len(new), round(time.perf_counter() - t0, 3),
                                          reused_timings=len(busy) - len(new))
    untimeable = {w for w in busy if rows_max is not None and w.rows > rows_max}
    side = _RankSide(table, timer, launch_of, untimeable, progress, budget)
    design = design_sample(timeable, budget // DESIGN_SHARE, launch_of, limit=budget)
    plan = run_plan(side, design, budget, known=known, seconds=seconds)
    lookup = RankTimes(plan.timed, plan.model)
    held = error_summary(plan.held_out.get("", []))
    info = RankPlan(
        "model", len(busy), len(plan.done), 0.0, design_timings=len(plan.design),
        decisive_timings=len(plan.done) - len(plan.design), decisive_rounds=plan.rounds,
        cost_model={**plan.model.record(), "cross_validated": error_summary(side.cv or []), "held_out": held,
                    "tolerance": tolerance,
                    "within_tolerance": held["rms_rel"] is not None and held["rms_rel"] <= tolerance},
        decided_by_timing_share=decided_share(table, lookup, plan.timed, side.error(plan.held_out)),
        timed_rows_max=rows_max, untimeable_workloads=len(untimeable), reused_timings=len(plan.timed) - len(plan.done),
        stopped_by=plan.stopped_by)
    info.wall_s = round(time.perf_counter() - t0, 3)
    return lookup, info
