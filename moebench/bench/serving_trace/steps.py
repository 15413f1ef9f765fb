"""A serving trace's per-step figures: every distinct step's as columns (StepFigures: its real tokens, the rows
each producer added, both sides' single-rank layer times, padded GEMM rows, EP excess routes, fixed-capacity
capacities and, with EP ranks, the EP step's figures), one step's as a record, and every step's figures as the
columns of the run's step file."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.step_calls import StepCalls
from moebench.dispatch.pack import CapacityKnobs, capacity_for
from moebench.params import Params

STEP_RECORDS_MAX = 5_000  # longer traces keep one record per distinct step (with its count) instead of every step


class StepFigures:
    """Every distinct step's figures as columns [S] (per side where timed or routed), from the steps' calls
    (step_calls.StepCalls), each call shape's routing figures (`figures[(rows, real)]`: shapes.ShapeFigures) and the
    layer time of a call shape (`time_of(side, rows, real)`). Per step and side: the single-rank layer time over its
    calls and of their real tokens alone (each summed over the calls in step_padding's order, as compose does), the
    padded GEMM rows, the EP excess routes (per micro-batch, its calls' rank loads added, the slowest rank over the
    mean), and with EP ranks each micro-batch's fixed-capacity capacity (the largest per-rank receive of its calls).
    `record(i)` is one step's record; `ep` (ep_arrays.EPColumns, set by the EP step) adds its figures."""

    def __init__(self, p: Params, calls: StepCalls, figures: dict, time_of):
        self.p, self.calls = p, calls
        S = calls.num_steps
        rows = calls.rows.reshape(S, -1)  # every call of a step, in step_padding's order (dp, micro-batch, sp)
        real = calls.real.reshape(S, -1)
        on = rows > 0
        keys = rows * (int(real.max(initial=0)) + 1) + real
        shape_keys, at = np.unique(keys[on], return_inverse=True)
        where = np.zeros(rows.shape, dtype=np.int64)
        where[on] = at
        first = np.zeros(len(shape_keys), dtype=np.int64)
        first[at] = np.flatnonzero(on.reshape(-1))
        shapes = [(int(r), int(q)) for r, q in zip(rows.reshape(-1)[first].tolist(), real.reshape(-1)[first].tolist())]
        self.layer_us, self.real_only_us, self.padding_gemm_rows, self.ep_excess_routes = {}, {}, {}, {}
        self.capacity: dict[str, np.ndarray] = {}
        M = calls.rows.shape[2]
        at_rows = figures.positions(shapes) if hasattr(figures, "positions") else None  # looked up once
        mb_of_call = np.broadcast_to(np.arange(M)[None, :, None], calls.rows.shape[1:]).reshape(-1)
        for side in SIDES:
            many = getattr(time_of, "many", None)  # the shape model's lookup of many shapes at once
            t = (many(side, shapes) if many else
                 np.asarray([time_of(side, r, q) for r, q in shapes], dtype=np.float64))
            with_real = [i for i, (_, q) in enumerate(shapes) if q]
            reals = [(shapes[i][1], shapes[i][1]) for i in with_real]
            alone = np.zeros(len(shapes))
            if with_real:
                alone[with_real] = many(side, reals) if many else [time_of(side, *s) for s in reals]
            gemm, loads, most = (_shape_column(figures, what, side, shapes, at_rows)
                                 for what in ("padding_gemm_rows", "rank_loads", "max_rows_per_rank"))
            loads = loads.reshape(len(shapes), -1)
            layer, only = np.zeros(S), np.zeros(S)
            for c in range(rows.shape[1]):  # in call order, as compose's sum over a step's calls
                layer = layer + np.where(on[:, c], t[where[:, c]], 0.0)
                only = only + np.where(on[:, c] & (real[:, c] > 0), alone[where[:, c]], 0.0)
            self.layer_us[side], self.real_only_us[side] = layer, only
            self.padding_gemm_rows[side] = np.where(on, gemm[where], 0).sum(axis=1)
            excess, caps = np.zeros(S), np.zeros((S, M), dtype=np.int64)
            for m in range(M):
                in_mb = on & (mb_of_call[None, :] == m)
                mb_loads = np.zeros((S, loads.shape[1]), dtype=np.int64)
                for c in np.flatnonzero(mb_of_call == m).tolist():
                    mb_loads += np.where(in_mb[:, c:c + 1], loads[where[:, c]], 0)
                if loads.shape[1]:
                    excess = excess + (mb_loads.max(axis=1) - mb_loads.sum(axis=1) / loads.shape[1])
                caps[:, m] = np.where(in_mb, most[where], 0).max(axis=1, initial=0)
            self.ep_excess_routes[side] = excess
            if p.ep_size > 1:
                self.capacity[side] = _capacities(caps, p)
        self.ep = None

    def __len__(self) -> int:
        return self.calls.num_steps

    def record(self, i: int) -> dict[str, Any]:
        """Step i's record: its real tokens, the rows each producer added, both sides' single-rank layer times,
        padded GEMM rows, EP excess routes, fixed-capacity capacities and the EP step's figures."""
        step = self.calls.step(i)
        rec: dict[str, Any] = {
            "real": list(step.real), "cudagraph_rows": list(step.cudagraph_rows), "dp_rows": step.dp_rows,
            "micro_batch_rows": list(step.micro_batch_rows), "sp_rows": list(step.sp_rows),
            "chunk_rows": list(step.chunk_rows), "calls": len(step.calls),
            "rows": sum(c.rows for c in step.calls), "padded_rows": step.padded_rows,
            "added_rows": step.added_rows(),
            "layer_us": {s: round(float(self.layer_us[s][i]), 3) for s in SIDES},
            "real_only_us": {s: round(float(self.real_only_us[s][i]), 3) for s in SIDES},
            "padding_gemm_rows": {s: int(self.padding_gemm_rows[s][i]) for s in SIDES},
            "ep_excess_routes": {s: float(self.ep_excess_routes[s][i]) for s in SIDES}}
        if self.p.ep_size > 1:
            rec["capacity"] = {s: self.capacity[s][i].tolist() for s in SIDES}
        if self.ep is not None:
            rec.update({name: {s: round(float(self.ep.sides[s][k][i]), 3) for s in SIDES}
                        for name, k in EP_FIGURES.items()})
            rec["ep_slowest_rank"] = {s: int(self.ep.sides[s]["slowest_rank"][i]) for s in SIDES}
        return rec

    def weighted(self, column: np.ndarray, counts) -> float:
        """The sum of a column over the trace (each distinct step times its count), exactly rounded."""
        return math.fsum((np.asarray(counts, dtype=np.int64) * column).tolist())

    def totals(self, counts) -> dict[str, dict[str, float]]:
        """compose.layer_totals over the columns: layer, real-only and padding time per side, summed over the trace."""
        out = {what: {s: self.weighted(getattr(self, what)[s], counts) for s in SIDES}
               for what in ("layer_us", "real_only_us")}
        out["padding_us"] = {s: out["layer_us"][s] - out["real_only_us"][s] for s in SIDES}
        return out

    def distinct_capacities(self, side: str) -> int:
        """How many distinct capacities the steps' micro-batches ask for (fixed-capacity compiles)."""
        return int(np.unique(self.capacity[side]).size)


def step_percentiles(values: np.ndarray, counts) -> dict[str, float]:
    """{p50, p99, max} of a figure over the trace's steps (each distinct step counted as often as it occurs): the
    smallest value at least that share of the steps do not exceed."""
    values, w = np.asarray(values, dtype=np.float64), np.asarray(counts, dtype=np.int64)
    if not len(values):
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(w[order])
    at = {q: values[order][min(len(values) - 1, int(np.searchsorted(cum, q * cum[-1], side="left")))]
          for q in (0.5, 0.99)}
    return {"p50": round(float(at[0.5]), 3), "p99": round(float(at[0.99]), 3), "max": round(float(values.max()), 3)}


def _shape_column(figures, what: str, side: str, shapes: list[tuple[int, int]], at_rows) -> np.ndarray:
    """A routing figure of `shapes`: read off a ShapeFigureTable's arrays (at its rows `at_rows`), or shape by
    shape off ShapeFigures."""
    if at_rows is not None:
        return figures.column(what, side, at_rows)
    return np.asarray([getattr(figures[s], what)[side] for s in shapes], dtype=np.int64)


def _capacities(need: np.ndarray, p: Params) -> np.ndarray:
    """Per micro-batch need (the largest per-rank receive of its calls) -> the fixed-capacity dispatch's capacity;
    a receive larger than the buffer would not fit any capacity: it is counted at the buffer's capacity."""
    cap = p.knobs(CapacityKnobs)
    buffer = cap.num_max_tokens_per_rank
    distinct, at = np.unique(np.minimum(need, buffer), return_inverse=True)
    got = np.asarray([capacity_for(cap.capacity_policy, int(n), buffer) for n in distinct.tolist()], dtype=np.int64)
    return got[at].reshape(need.shape)


# an EP step's figure in the step records and the step file: (record and column name, EPColumns field)
EP_FIGURES = {"ep_step_us": "step_us", "ep_experts_us": "experts_us", "ep_mean_rank_us": "mean_rank_us",
              "ep_dispatch_us": "dispatch_us", "ep_combine_us": "combine_us"}


# the step file's columns: (column, what the figure is); per side for the timed ones
STEP_FILE_META = {"columns": {
    "real_dp<r>": "real tokens of DP rank r", "rows": "rows over the step's layer calls",
    "padded_rows": "padded rows over them", "distinct_step": "which distinct step (info.distinct_step_records)",
    "layer_us_<side>": "the single-rank view's layer time over the step's calls",
    "ep_step_us_<side>": "the EP step: dispatch + the slowest rank's experts + combine",
    "ep_experts_us_<side>": "the slowest rank's expert time", "ep_mean_rank_us_<side>": "the mean rank's",
    "ep_dispatch_us_<side>": "dispatch (wire model)", "ep_combine_us_<side>": "combine (wire model)",
    "ep_slowest_rank_<side>": "the slowest EP rank"}}


def step_columns(steps: StepFigures, index, dp_size: int) -> dict[str, np.ndarray]:
    """Every step's figures as columns (each distinct step's, read through the per-step index)."""
    idx = np.asarray(index, dtype=np.int64)
    calls = steps.calls
    cols: dict[str, np.ndarray] = {"distinct_step": idx.astype(np.int32)}
    for r in range(dp_size):
        cols[f"real_dp{r}"] = calls.real_tokens[:, r].astype(np.int32)[idx]
    cols["rows"] = calls.total_rows().astype(np.int32)[idx]
    cols["padded_rows"] = calls.padded_rows().astype(np.int32)[idx]
    for side in SIDES:
        # rounded as the step records round them
        cols[f"layer_us_{side}"] = np.round(steps.layer_us[side], 3).astype(np.float32)[idx]
        if steps.ep is not None:
            for name, k in EP_FIGURES.items():
                cols[f"{name}_{side}"] = np.round(steps.ep.sides[side][k], 3).astype(np.float32)[idx]
            cols[f"ep_slowest_rank_{side}"] = steps.ep.sides[side]["slowest_rank"].astype(np.int32)[idx]
    return cols
