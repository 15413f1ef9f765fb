"""One EP rank's expert work in an EP step: timed on this device, or read off a cost model fitted to such timings.

A rank's workload after dispatch is `Workload(rows, counts)`: the rows it received (each has at least one route to
its experts) and the routes to each of its local experts. Its time is the layer's expert kernel on exactly that
workload (fused_experts on bf16 rows, fused_experts_fp8 on e4m3 rows staged as the layer stages them), built by
`workload_ids`: local ids with those per-expert counts over those rows. A grouped GEMM's time depends on the rows,
the per-expert counts (row tiles, whose weights are read) and top_k, not on the values, so the synthetic rows time
the rank as its real rows would.

The cost model: time = coef . (1, experts touched, row tiles of TILE_ROWS rows, routes, rows), coef >= 0, fitted
by non-negative least squares to timed workloads (the weight reads scale with experts touched, the GEMM issue with
row tiles, staging and the sum with routes and rows). `RankCostModel.record()` keeps the fit's error on its own
workloads; the EP step's replay check times every rank of the first steps directly and compares.

`rank_times(workloads, timer, budget, complete)`: the rank time lookup the EP step reads (every workload timed, or
the model fitted to a sample), and its record.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from moebench.params import Params, Timing

TILE_ROWS = 64  # the row tile the alignment pads each expert's routes to (the layer's block size)
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


def features(w: Workload) -> list[float]:
    """The cost model's features of a workload (FEATURES)."""
    return [1.0 if w.rows else 0.0, float(sum(1 for c in w.counts if c)),
            float(sum(math.ceil(c / TILE_ROWS) for c in w.counts)), float(w.routes), float(w.rows)]


def features_batch(counts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """features() of many workloads at once: counts int64 [R, E], rows int64 [R] -> float64 [R, len(FEATURES)]."""
    busy = (rows > 0).to(torch.float64)
    return torch.stack([busy, (counts > 0).sum(dim=1).to(torch.float64),
                        ((counts + TILE_ROWS - 1) // TILE_ROWS).sum(dim=1).to(torch.float64),
                        counts.sum(dim=1).to(torch.float64), rows.to(torch.float64)], dim=1)


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


class RankTimer:
    """Times workloads with the layer's expert kernel on `device` (p50 microseconds of measure(), the shape timing
    of the serving trace); one rank's weights (p.local_experts experts) built once."""

    def __init__(self, p: Params, device: torch.device, timing: Timing):
        from moebench.bench.experts_fp8 import quantized_expert_weights
        from moebench.inputs import cached_expert_weights

        self.p, self.device, self.timing = p, device, timing
        E, H, I = p.local_experts, p.hidden, p.intermediate
        if p.expert_dtype == "fp8":
            self.weights = quantized_expert_weights(E, H, I, seed=p.seed, device=device)
        else:
            self.weights = cached_expert_weights(E, H, I, p.seed, device)
        self.timed = 0

    def _runner(self, w: Workload) -> Callable[[], Any]:
        from moebench.kernels.fused_experts import fused_experts, make_workspace
        from moebench.kernels.fused_experts_fp8 import fused_experts_fp8, make_fp8_workspace
        from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs_torch

        p, dev = self.p, self.device
        K, E, H, I = p.top_k, p.local_experts, p.hidden, p.intermediate
        g = torch.Generator(device="cpu").manual_seed(p.seed * 7_919 + w.rows)
        ids = workload_ids(w, K, dev)
        topk_w = torch.rand(w.rows, K, generator=g).to(dev)
        x = torch.randn(w.rows, H, generator=g).to(device=dev, dtype=torch.bfloat16)
        out = torch.empty(w.rows, H, dtype=torch.bfloat16, device=dev)
        if p.expert_dtype == "fp8":
            x_q, x_sf, _, _ = prepare_moe_inputs_torch(x, topk_w, ids.to(torch.int64), None, p.group_size,
                                                       p.scale_format)
            ws = make_fp8_workspace(w.rows, K, E, H, I, device=dev, group_size=p.group_size,
                                    scale_format=p.scale_format)
            w13_q, w13_s, w2_q, w2_s = self.weights
            return lambda: fused_experts_fp8(x_q, x_sf, ids, topk_w, w13_q, w13_s, w2_q, w2_s,
                                             group_size=p.group_size, scale_format=p.scale_format, workspace=ws,
                                             out=out)
        w13, w2 = self.weights
        ws = make_workspace(w.rows, K, E, H, I, dtype=torch.bfloat16, device=dev)
        return lambda: fused_experts(x, w13, w2, topk_w, ids, workspace=ws, out=out)

    def __call__(self, w: Workload) -> float:
        if w.rows == 0:
            return 0.0
        from moebench.measure.timing import measure

        fn = self._runner(w)
        self.timed += 1
        return float(measure(fn, self.timing, self.device, graph_capturable=True).stats["p50"])


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


@dataclass
class RankCostModel:
    coef: list[float]  # per FEATURES, microseconds per unit
    fit_workloads: int
    fit_max_rel: float  # on the workloads it was fitted to
    fit_rms_rel: float

    @classmethod
    def fit(cls, workloads: Sequence[Workload], times_us: Sequence[float]) -> "RankCostModel":
        rows = [(features(w), t) for w, t in zip(workloads, times_us) if w.rows]
        if not rows:
            raise ValueError("RankCostModel.fit: no workload with rows to fit to")
        coef = nnls([f for f, _ in rows], [t for _, t in rows])
        model = cls(coef, len(rows), 0.0, 0.0)
        rel = [abs(model.predict(w) - t) / t for w, t in zip(workloads, times_us) if w.rows and t > 0]
        model.fit_max_rel = max(rel, default=0.0)
        model.fit_rms_rel = math.sqrt(sum(r * r for r in rel) / len(rel)) if rel else 0.0
        return model

    def predict(self, w: Workload) -> float:
        return sum(c * f for c, f in zip(self.coef, features(w))) if w.rows else 0.0

    __call__ = predict

    def batch(self, counts: torch.Tensor, rows: torch.Tensor) -> list[float]:
        """predict() of every rank of a micro-batch: counts [R, E], rows [R]."""
        f = features_batch(counts, rows)
        return ((f @ torch.tensor(self.coef, dtype=torch.float64)) * (rows > 0)).tolist()

    def record(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "coef_us": [round(c, 6) for c in self.coef],
                "tile_rows": TILE_ROWS, "fit_workloads": self.fit_workloads,
                "fit_max_rel": round(self.fit_max_rel, 5), "fit_rms_rel": round(self.fit_rms_rel, 5)}


def fit_sample(workloads: Sequence[Workload], budget: int) -> list[Workload]:
    """Up to `budget` of the distinct workloads to time for a fit, spread over their range: the extremes of routes,
    rows, experts touched and row tiles first, then evenly spaced quantiles of routes (the model is linear: its
    points must span what it will be read at)."""
    distinct = sorted({w for w in workloads if w.rows}, key=lambda w: (w.routes, w.rows, w.counts))
    if len(distinct) <= budget:
        return distinct
    picked: dict[Workload, None] = {}
    for key in (lambda w: w.routes, lambda w: w.rows, lambda w: features(w)[1], lambda w: features(w)[2]):
        for pick in (max(distinct, key=key), min(distinct, key=key)):
            if len(picked) < budget:
                picked[pick] = None
    n, spots = len(distinct), max(2, budget)
    for i in range(spots):
        if len(picked) >= budget:
            break
        picked[distinct[round(i * (n - 1) / (spots - 1))]] = None
    j = 0
    while len(picked) < budget:  # quantiles that hit the extremes again: the next workloads in order
        picked.setdefault(distinct[j], None)
        j += 1
    return sorted(picked, key=lambda w: (w.routes, w.rows, w.counts))


def rank_times(workloads: set[Workload], timer: Callable[[Workload], float], budget: int, complete: bool = True
               ) -> tuple[Callable[[Workload], float], dict[str, Any]]:
    """(rank time lookup, its record): every workload timed when there are at most `budget` and they are all of
    the trace's (`complete`), else a cost model fitted to `budget` of them."""
    t0 = time.perf_counter()
    busy = [w for w in workloads if w.rows]
    if complete and len(busy) <= budget:
        table = {w: timer(w) for w in busy}
        return (lambda w: table[w] if w.rows else 0.0), {
            "rank_times": "timed", "distinct_workloads": len(busy), "rank_timings": len(busy),
            "wall_s": round(time.perf_counter() - t0, 3)}
    sample = fit_sample(busy, budget)
    model = RankCostModel.fit(sample, [timer(w) for w in sample])
    return model, {"rank_times": "model", "distinct_workloads": len(busy), "rank_timings": len(sample),
                   "cost_model": model.record(), "wall_s": round(time.perf_counter() - t0, 3)}
