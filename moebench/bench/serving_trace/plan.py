"""The timed-sample engine both of serving_trace's cost models use (the EP ranks' workloads, rank_cost.py; the
single-rank view's shapes, shape_cost.py): which points to time, the fit, and the error it states.

A side (rank workloads or shapes) has points to price, more than the budget lets it time. The engine (`run_plan`):
  1. design: per launch config, the corners and an even spread of its points (`designed_set`), about
     budget // DESIGN_SHARE in all; the fit's own error is its k-fold cross-validation (`cross_validated`);
  2. decide: rounds of at most ROUND points, the side's most decisive untimed ones first (`Side.next_round`: what
     the answer reads most); each round is predicted before it is timed, and those predictions against the timings
     are the model's held-out error, on exactly the points the answer reads; the model is refitted after each;
     the rounds stop at the budget's count of timings or, where the side gives one, its budget in seconds (a
     GPU's prefill-sized workloads take tens of milliseconds a timing).
The fit (`fit_relative`): non-negative coefficients of a linear cost over features per launch config, minimising
the relative error (non-negative least squares, `nnls`). Points of more rows than the device times are priced,
never timed (`can_time`: the interpreter's layer call costs seconds a row at its sizes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

import torch

MIN_PER_LAUNCH = 8  # design points per launch config (a fit has 5-6 coefficients; fewer points: all of them timed)
DESIGN_SHARE = 3  # the design takes budget // DESIGN_SHARE timings, the decisive rounds the rest
CV_FOLDS = 4
ROUND = 32  # decisive timings between refits
# the most rows a timed point has, per device kind (None: any): the interpreter's layer call costs ~15 ms a row at
# the CPU sizes (a 2048-row call over half a minute), so there larger points are the model's, extrapolated in rows
TIMED_ROWS_MAX = {"cuda": None, "cpu": 128}


def can_time(rows: int, device_kind: str) -> bool:
    """Whether a point of `rows` rows is timed on a device of this kind ("cuda" or "cpu")."""
    limit = TIMED_ROWS_MAX[device_kind]
    return limit is None or rows <= limit


def nnls(a: Sequence[Sequence[float]], b: Sequence[float], iters: int = 100) -> list[float]:
    """Non-negative least squares, min |a x - b| over x >= 0 (Lawson-Hanson active set; a few features)."""
    A = torch.tensor(a, dtype=torch.float64)
    y = torch.tensor(b, dtype=torch.float64)
    n = A.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    free = torch.zeros(n, dtype=torch.bool)
    for _ in range(iters):
        grad = A.T @ (y - A @ x)
        candidates = (~free) & (grad > 1e-12 * max(1.0, float(grad.abs().max())))
        if not candidates.any():
            break
        free[int(torch.where(candidates, grad, torch.tensor(-math.inf, dtype=torch.float64)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            idx = free.nonzero().flatten()
            z[idx] = torch.linalg.lstsq(A[:, idx], y.unsqueeze(1)).solution.flatten()
            if (z[idx] > 0).all():
                x = z
                break
            neg = idx[z[idx] <= 0]
            alpha = min(float(x[i] / (x[i] - z[i])) for i in neg)
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x.tolist()


def rel_error(pred: float, got: float) -> float:
    """|pred - got| / got (0 where got is not positive)."""
    return abs(pred - got) / got if got > 0 else 0.0


def error_summary(rel: Sequence[float]) -> dict[str, Any]:
    """{points, rms_rel, max_rel} of relative errors."""
    return {"points": len(rel), "rms_rel": round(math.sqrt(sum(r * r for r in rel) / len(rel)), 5) if rel else None,
            "max_rel": round(max(rel), 5) if rel else None}


def fit_relative(points: Sequence[tuple[list[float], float]]) -> list[float]:
    """Non-negative coefficients of a linear cost over (features, time) points, minimising the relative error (what
    the record states: each row weighted by 1/time)."""
    return nnls([[v / t for v in f] for f, t in points], [1.0] * len(points))


def cross_validated(points: Sequence[tuple[list[float], float]], folds: int = CV_FOLDS) -> list[float]:
    """Each point's relative error under a fit to the others' folds (point i in fold i % folds); none under twice
    as many points as features."""
    if not points or len(points) < 2 * len(points[0][0]):
        return []
    rel = []
    for k in range(folds):
        train = [pt for i, pt in enumerate(points) if i % folds != k]
        coef = fit_relative(train)
        rel += [rel_error(sum(c * v for c, v in zip(coef, f)), t) for i, (f, t) in enumerate(points) if i % folds == k]
    return rel


def designed_set(groups: dict[str, list], corners: Callable[[list], Sequence[Callable]], target: int,
                 limit: int | None = None) -> list:
    """A designed set of points to time, from `groups` (per launch config, each list sorted in the order to spread
    over): per group the extremes of each of corners(group)'s keys, then an even spread over the list; at least
    MIN_PER_LAUNCH a group (all of a group with fewer), the rest of `target` shared by the groups' sizes; at most
    `limit` in all, taken from the groups in turn (a limit below the groups' minimum still reaches every group)."""
    total = sum(len(g) for g in groups.values())
    picked: list[list] = []
    for name, group in sorted(groups.items()):
        want = max(MIN_PER_LAUNCH, round(target * len(group) / max(1, total)))
        if len(group) <= want:
            picked.append(list(group))
            continue
        mine: dict = {}
        for key in corners(group):
            mine[max(group, key=key)] = None
            mine[min(group, key=key)] = None
        n = len(group)
        for i in range(want):
            if len(mine) >= want:
                break
            mine.setdefault(group[round(i * (n - 1) / max(1, want - 1))], None)
        j = 0
        while len(mine) < want:  # spread points that hit the corners again: the next ones in order
            mine.setdefault(group[j], None)
            j += 1
        picked.append(list(mine))
    limit = sum(map(len, picked)) if limit is None else limit
    out: list = []
    for i in range(max((len(g) for g in picked), default=0)):
        for g in picked:
            if i < len(g) and len(out) < limit:
                out.append(g[i])
    return out


class Side(Protocol):
    """What the engine asks of a side. A point is what is timed at once (a workload; a shape, both of its sides);
    a key is one timed figure of a point (the workload; (side, rows, real)), its series the error it counts in."""

    def time(self, points: Sequence[Hashable]) -> Mapping[Hashable, float]:
        """Time the points: {key: microseconds}."""

    def fit(self, timed: Mapping[Hashable, float]) -> Any:
        """A model fitted to the timed keys."""

    def predict(self, model: Any, points: Sequence[Hashable]) -> dict[Hashable, tuple[str, float]]:
        """{key: (series, the model's microseconds)} of the points' keys."""

    def next_round(self, model: Any, timed: Mapping[Hashable, float], held_out: Mapping[str, list[float]],
                   done: set) -> list[Hashable]:
        """The untimed points to time next, most decisive first."""


@dataclass
class Plan:
    """What run_plan timed and fitted: every key's timing (the known ones too), the last model, the design, the
    points timed now, the held-out relative errors per series, the decisive rounds and why they stopped
    ("budget", "candidates": none left, or "seconds")."""

    timed: dict
    model: Any
    design: list
    done: set
    held_out: dict[str, list[float]] = field(default_factory=dict)
    rounds: int = 0
    stopped_by: str = "budget"


def run_plan(side: Side, design: Sequence[Hashable], budget: int, round_size: int = ROUND, *,
             known: Mapping[Hashable, float] | None = None, seconds: float | None = None,
             clock: Callable[[], float] = time.perf_counter) -> Plan:
    """Time the design, fit, then rounds of at most `round_size` of the side's decisive points until `budget`
    points are timed or, after a round, `seconds` have passed since the start (module docstring). `known`: keys
    timed before (a point is then one key: the rank side's workloads), read as timed, never timed again nor
    counted in the budget, and fitted with the rest."""
    start = clock()
    timed = dict(known or {})
    design = [d for d in design if d not in timed]
    timed.update(side.time(design))
    done = set(design)
    model = side.fit(timed)
    held: dict[str, list[float]] = {}
    rounds, stopped_by = 0, "budget"
    while len(done) < budget:
        if seconds is not None and clock() - start >= seconds:
            stopped_by = "seconds"
            break
        batch = side.next_round(model, timed, held, done)[:min(round_size, budget - len(done))]
        if not batch:
            stopped_by = "candidates"
            break
        predicted = side.predict(model, batch)
        got = side.time(batch)
        timed.update(got)
        done.update(batch)
        for key, (series, pr) in predicted.items():
            held.setdefault(series, []).append(rel_error(pr, got[key]))
        model = side.fit(timed)
        rounds += 1
    return Plan(timed, model, list(design), done, held, rounds, stopped_by)
