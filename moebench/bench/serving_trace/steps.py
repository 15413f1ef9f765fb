"""A serving trace's per-step figures: one record per distinct step (its real tokens, the rows each producer added,
both sides' single-rank layer times, padded GEMM rows, EP excess routes, fixed-capacity capacities and, with EP
ranks, the EP step's figures), and every step's figures as the columns of the run's step file."""

from __future__ import annotations

from typing import Any

import numpy as np

from moebench.bench.serving_trace.ep_step import SideStep
from moebench.bench.serving_trace.record import SIDES
from moebench.dispatch.pack import CapacityKnobs, capacity_for
from moebench.inputs.engine_padding import StepPadding
from moebench.params import Params

STEP_RECORDS_MAX = 5_000  # longer traces keep one record per distinct step (with its count) instead of every step


def _capacities(step: StepPadding, figures: dict, side: str, p: Params) -> list[int]:
    """Per micro-batch: the fixed-capacity dispatch's capacity (the largest per-rank receive of its calls)."""
    caps = []
    for m in range(len(step.micro_batch_rows)):
        need = max((figures[(c.rows, c.real)].max_rows_per_rank[side] for c in step.calls if c.micro_batch == m),
                   default=0)
        # a receive larger than the buffer would not fit any capacity: it is counted at the buffer's capacity
        cap = p.knobs(CapacityKnobs)
        caps.append(capacity_for(cap.capacity_policy, min(need, cap.num_max_tokens_per_rank),
                                 cap.num_max_tokens_per_rank))
    return caps


def ep_excess(step: StepPadding, figures: dict, side: str) -> float:
    """The slowest EP rank's routes over the mean rank's, summed over the step's micro-batches: the calls of one
    micro-batch (every DP and SP rank) dispatch to the same EP ranks together, so their loads add up first."""
    excess = 0.0
    for m in range(len(step.micro_batch_rows)):
        loads = [0] * len(next(iter(figures.values())).rank_loads[side]) if figures else []
        for c in step.calls:
            if c.micro_batch == m:
                loads = [a + b for a, b in zip(loads, figures[(c.rows, c.real)].rank_loads[side])]
        if loads:
            excess += max(loads) - sum(loads) / len(loads)
    return excess


def step_records(p: Params, paddings, per_step, figures) -> list[dict[str, Any]]:
    """One record per distinct step (its real tokens, the rows each producer added, both sides' single-rank
    layer times, padded GEMM rows, EP excess routes and fixed-capacity capacities)."""
    out = []
    for step, times in zip(paddings, per_step):
        rec: dict[str, Any] = {
            "real": list(step.real), "cudagraph_rows": list(step.cudagraph_rows), "dp_rows": step.dp_rows,
            "micro_batch_rows": list(step.micro_batch_rows), "sp_rows": list(step.sp_rows),
            "chunk_rows": list(step.chunk_rows), "calls": len(step.calls),
            "rows": sum(c.rows for c in step.calls), "padded_rows": step.padded_rows,
            "added_rows": step.added_rows(),
            "layer_us": {s: round(v, 3) for s, v in times["layer_us"].items()},
            "real_only_us": {s: round(v, 3) for s, v in times["real_only_us"].items()},
            "padding_gemm_rows": {s: sum(figures[(c.rows, c.real)].padding_gemm_rows[s] for c in step.calls)
                                  for s in SIDES},
            "ep_excess_routes": {s: ep_excess(step, figures, s) for s in SIDES}}
        if p.ep_size > 1:
            rec["capacity"] = {s: _capacities(step, figures, s, p) for s in SIDES}
        out.append(rec)
    return out


# the step file's columns: (column, what the figure is); per side for the timed ones
STEP_FILE_META = {"columns": {
    "real_dp<r>": "real tokens of DP rank r", "rows": "rows over the step's layer calls",
    "padded_rows": "padded rows over them", "distinct_step": "which distinct step (info.distinct_step_records)",
    "layer_us_<side>": "the single-rank view's layer time over the step's calls",
    "ep_step_us_<side>": "the EP step: dispatch + the slowest rank's experts + combine",
    "ep_experts_us_<side>": "the slowest rank's expert time", "ep_mean_rank_us_<side>": "the mean rank's",
    "ep_dispatch_us_<side>": "dispatch (wire model)", "ep_combine_us_<side>": "combine (wire model)",
    "ep_slowest_rank_<side>": "the slowest EP rank"}}


def step_columns(distinct: list[dict], index, dp_size: int) -> dict[str, np.ndarray]:
    """Every step's figures as columns (each distinct step's, read through the per-step index)."""
    idx = np.asarray(index, dtype=np.int64)
    cols: dict[str, np.ndarray] = {"distinct_step": idx.astype(np.int32)}

    def column(values, dtype) -> np.ndarray:
        return np.asarray(values, dtype=dtype)[idx]

    for r in range(dp_size):
        cols[f"real_dp{r}"] = column([d["real"][r] for d in distinct], np.int32)
    cols["rows"] = column([d["rows"] for d in distinct], np.int32)
    cols["padded_rows"] = column([d["padded_rows"] for d in distinct], np.int32)
    for side in SIDES:
        cols[f"layer_us_{side}"] = column([d["layer_us"][side] for d in distinct], np.float32)
        if distinct and "ep_step_us" in distinct[0]:
            for name in ("ep_step_us", "ep_experts_us", "ep_mean_rank_us", "ep_dispatch_us", "ep_combine_us"):
                cols[f"{name}_{side}"] = column([d[name][side] for d in distinct], np.float32)
            cols[f"ep_slowest_rank_{side}"] = column([d["ep_slowest_rank"][side] for d in distinct], np.int32)
    return cols


def ep_fields(ep: dict[str, SideStep]) -> dict[str, Any]:
    """A step's EP-step figures, per side (the per-step records and the step file's columns)."""
    return {"ep_step_us": {s: round(v.step_us, 3) for s, v in ep.items()},
            "ep_experts_us": {s: round(v.experts_us, 3) for s, v in ep.items()},
            "ep_mean_rank_us": {s: round(v.mean_rank_us, 3) for s, v in ep.items()},
            "ep_dispatch_us": {s: round(v.dispatch_us, 3) for s, v in ep.items()},
            "ep_combine_us": {s: round(v.combine_us, 3) for s, v in ep.items()},
            "ep_slowest_rank": {s: v.slowest_rank for s, v in ep.items()}}
