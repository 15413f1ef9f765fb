"""One EP rank's expert work in an EP step as a cost model fitted to timed workloads (rank_timing.py times them;
rank_plan.py decides which).

A rank's workload after dispatch is `Workload(rows, counts)`: the rows it received (each has at least one route to
its experts) and the routes to each of its local experts. The expert kernel's launch config depends on the rows
(the tuned table's bucket of next_pow2(rows), else the rule's rows per expert), and with it BLOCK_M, so the model
follows the kernel: per launch config (`Launch`: the config the kernel picks at those rows on this device),

    time = coef . (1, experts touched, row tiles, routes, rows),  coef >= 0 (non-negative least squares)

with row tiles counted at that config's BLOCK_M (a paired config's full tiles of two blocks plus an odd last
one): weight reads scale with the experts touched, the GEMM issue with the row tiles, staging and the sum with the
routes and rows. A model fitted across configs, or with a fixed tile size, misreads every workload whose config
differs (that was a 5-6% miss on an H100).

The plan that decides which workloads are timed is rank_plan.py; `design_sample` is its first step here, as it
reads the features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.launch import Launch, launches_of, row_tiles
from moebench.bench.serving_trace.plan import cross_validated, designed_set, error_summary, fit_relative

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
    hash of their figures, then compared whole)."""

    def __init__(self, timed: dict[Workload, float], model: RankCostModel | None = None):
        self.timed, self.model = dict(timed), model
        self._tables: dict[int, tuple[np.ndarray, ...]] = {}

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

    def _table(self, width: int) -> tuple[np.ndarray, ...]:
        """The timed workloads of `width` local experts, sorted by hash: (hashes, rows, counts, times), made once."""
        got = self._tables.get(width)
        if got is None:
            items = [(w, t) for w, t in self.timed.items() if len(w.counts) == width]
            rows = np.asarray([w.rows for w, _ in items], dtype=np.int64)
            counts = np.asarray([w.counts for w, _ in items], dtype=np.int64).reshape(len(items), width)
            hashes = _workload_hash(counts, rows)
            order = np.argsort(hashes, kind="stable")
            got = self._tables[width] = (hashes[order], rows[order], counts[order],
                                         np.asarray([t for _, t in items], dtype=np.float64)[order])
        return got

    def batch_array(self, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Many workloads at once: counts int [N, E], rows int [N] -> float64 [N]."""
        counts, rows = np.asarray(counts, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        out = self.model.batch(counts, rows) if self.model is not None else np.zeros(len(rows))
        out = np.asarray(out, dtype=np.float64).copy()
        timed = np.zeros(len(rows), dtype=bool)
        hashes, t_rows, t_counts, t_times = self._table(counts.shape[1]) if self.timed and len(rows) else ((),) * 4
        if len(hashes):
            keys = _workload_hash(counts, rows)
            first = np.searchsorted(hashes, keys)
            # timed workloads of one hash (a collision) lie side by side: each is compared whole
            run = int(np.max(np.unique(hashes, return_counts=True)[1]))
            for shift in range(run):
                at = np.minimum(first + shift, len(hashes) - 1)
                hit = ((hashes[at] == keys) & (t_rows[at] == rows) & (t_counts[at] == counts).all(axis=1)
                       & ~timed)
                out[hit], timed[hit] = t_times[at[hit]], True
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


def design_sample(workloads: Sequence[Workload], target: int, launch_of: Callable[[int], Launch],
                  limit: int | None = None) -> list[Workload]:
    """About `target` workloads (never more than `limit`) to time for the fit: per launch config its corners (most
    and fewest routes, rows, experts touched, row tiles), then an even spread by routes (designed_set). The
    features are computed once per launch config, as arrays (a long trace has 10^5 workloads)."""
    groups: dict[str, list[Workload]] = {}
    for w in workloads:
        if w.rows:
            groups.setdefault(launch_of(w.rows).name, []).append(w)
    shape_of: dict[Workload, tuple[int, int]] = {}  # (experts touched, row tiles)
    for group in groups.values():
        group.sort(key=lambda w: (w.routes, w.rows, w.counts))
        launch, n = launch_of(group[0].rows), len(group)
        f = feature_rows(np.asarray([w.counts for w in group], dtype=np.int64).reshape(n, -1),
                         np.asarray([w.rows for w in group]), np.full(n, launch.block_m), np.full(n, launch.paired))
        shape_of.update(zip(group, zip(f[1].tolist(), f[2].tolist())))

    def corners(group: list[Workload]) -> list[Callable[[Workload], Any]]:
        return [lambda w: w.routes, lambda w: w.rows, lambda w: shape_of[w][0], lambda w: shape_of[w][1]]
    return designed_set(groups, corners, target, limit)
