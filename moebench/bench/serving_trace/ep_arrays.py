"""The EP step of every distinct step at once: ep_step's composition as arithmetic over arrays.

ep_step.py composes one step at a time (its micro-batches' byte matrices, rank workloads and wire, then the
slowest rank); this module gives the same figures for all of a trace's distinct steps together, in chunks of
CHUNK_STEPS steps to bound memory, and equal to it float for float (tests/bench/serving_trace/test_ep_arrays.py
compares the two on several layouts, fills and DBO on and off).

Tables. Every figure of a micro-batch is a sum over its calls, and a call (rows, real) of source slot s reads s's
prefix tables at `real` (its real rows) and, oblivious, at rows - real (its padded rows): StepRoutes.slots. The
slots of one source (DP rank d, SP rank j) are its replicas: the same calls, each its own routing. So per source
and part (real, pad) the replicas' tables are summed once (`SourceTables`), indexed by the EP rank each figure
belongs to:
  experts    [n + 1, E]  routes to each expert (every rank's workload counts)
  received   [n + 1, R]  rows each EP rank receives
  own        [n + 1, R]  rows a rank sends itself (the wire matrix's diagonal: no wire)
  out_intra  [n + 1, R]  rows a rank sends to the other ranks of its node
  out_off    [n + 1, R]  rows a rank sends to any other rank
  in_intra   [n + 1, R]  rows a rank receives from the other ranks of its node
so a micro-batch's figures are a few gathers per source, whatever the EP size. With the rows a rank receives from
everyone (received - own) and sends (out_off), the off-node parts follow: in_inter = received - own - in_intra,
out_inter = out_off - out_intra; dispatch prices (out, in) x dispatch row bytes per link (WireModel's LinkModel),
combine the transpose (in, out) x combine row bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moebench.bench.serving_trace.ep_step import EPStepLayout
from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.step_calls import StepCalls
from moebench.dispatch.wire_model import WireModel

CHUNK_STEPS = 16_384  # steps composed together: [chunk, E] and [chunk, R] int64 arrays per source and figure
TABLES = ("experts", "received", "own", "out_intra", "out_off", "in_intra")
COLUMNS = ("step_us", "experts_us", "mean_rank_us", "dispatch_us", "combine_us", "dispatch_bytes", "combine_bytes",
           "slowest_rank", "slowest_us")


class SourceTables:
    """Per source (DP rank d, SP rank j) and part ("real", "pad"), its replicas' prefix tables summed (TABLES)."""

    def __init__(self, slots: dict, layout: EPStepLayout, dp_size: int, ranks_per_node: int):
        R = layout.ep_size
        node = np.arange(R) // ranks_per_node
        self.layout, self.dp_size = layout, dp_size
        self.tables: dict[tuple[int, int, str], dict[str, np.ndarray]] = {}
        for d in range(dp_size):
            for j in range(layout.sp_size):
                for part in ("real", "pad"):
                    out: dict[str, np.ndarray] = {}
                    for q in range(layout.replicas):
                        slot = layout.slot(q, dp_size, d, j)
                        _, real_tables, pad_tables = slots[slot]
                        experts, ranks = real_tables if part == "real" else pad_tables
                        ranks = ranks.astype(np.int64)
                        src = slot % R
                        same_node = node == node[src]
                        own = ranks[:, src]
                        figures = {"experts": experts.astype(np.int64), "received": ranks}
                        per_rank = {"own": own, "out_intra": ranks[:, same_node].sum(axis=1) - own,
                                    "out_off": ranks.sum(axis=1) - own}
                        in_intra = np.where(same_node, ranks, 0)
                        in_intra[:, src] = 0
                        figures["in_intra"] = in_intra
                        for k, v in figures.items():
                            _add(out, k, v)
                        for k, v in per_rank.items():
                            col = np.zeros((v.shape[0], R), dtype=np.int64)
                            col[:, src] = v
                            _add(out, k, col)
                    self.tables[(d, j, part)] = out

    def gather(self, calls: StepCalls, m: int, side: str) -> dict[str, np.ndarray]:
        """Every TABLES figure of micro-batch m of the steps `calls` on one side: int64 [S, E] or [S, R]."""
        out: dict[str, np.ndarray] = {}
        for d in range(self.dp_size):
            for j in range(self.layout.sp_size):
                real = calls.real[:, d, m, j]
                parts = [("real", real)] + ([("pad", calls.rows[:, d, m, j] - real)] if side == "oblivious" else [])
                for part, at in parts:
                    for k, table in self.tables[(d, j, part)].items():
                        _add(out, k, table[at])
        return out


def _add(into: dict[str, np.ndarray], key: str, value: np.ndarray) -> None:
    if key in into:
        into[key] = into[key] + value
    else:
        into[key] = value.copy()


def _in_order_mean(times: np.ndarray) -> np.ndarray:
    """[S, R] -> [S]: sum(row) / R with the row summed left to right, as Python's sum of a list does."""
    acc = times[:, 0].copy()
    for r in range(1, times.shape[1]):
        acc = acc + times[:, r]
    return acc / times.shape[1]


@dataclass
class EPColumns:
    """Per side, every distinct step's EP-step figures (ep_step.SideStep's scalar fields, as arrays [S]), and per
    step the oblivious side's padded routes (oblivious minus masked routes over the ranks) and those that went to
    its slowest rank."""

    sides: dict[str, dict[str, np.ndarray]]
    padded_routes: np.ndarray
    padded_routes_to_slowest: np.ndarray

    def totals(self, counts, dbo: bool) -> dict:
        """ep_step.step_totals of the columns, each step weighted by its count."""
        from moebench.bench.serving_trace.ep_step import SUMMED, SideStep, tax_split

        w = np.asarray(counts, dtype=np.int64)
        sums = {side: {k: math.fsum((w * self.sides[side][k]).tolist()) for k in SUMMED} for side in SIDES}
        m, o = (SideStep(**{k: sums[s][k] for k in SUMMED}) for s in SIDES)
        split = tax_split(m, o, dbo)
        split["straggler_wait_us"] = {s: sums[s]["experts_us"] - sums[s]["mean_rank_us"] for s in SIDES}
        return {"sums": sums, "tax": split}

    def padded_route_share(self, counts) -> float | None:
        """ep_step.padded_route_share over the columns."""
        w = np.asarray(counts, dtype=np.int64)
        total = int((w * self.padded_routes).sum())
        return int((w * self.padded_routes_to_slowest).sum()) / total if total else None


def compose_arrays(calls: StepCalls, tables: SourceTables, rank_times, wire: WireModel, layout: EPStepLayout,
                   chunk_steps: int = CHUNK_STEPS) -> EPColumns:
    """Every step's EP-step figures per side (see the module docstring); `rank_times.batch_array(counts [N, E/R],
    rows [N]) -> float64 [N]` (rank_cost.RankTimes)."""
    S = calls.num_steps
    sides = {side: {k: np.zeros(S, dtype=np.int64 if k in ("dispatch_bytes", "combine_bytes", "slowest_rank")
                                else np.float64) for k in COLUMNS} for side in SIDES}
    padded = np.zeros(S, dtype=np.int64)
    to_slowest = np.zeros(S, dtype=np.int64)
    for lo in range(0, S, chunk_steps):
        part = calls.take(slice(lo, min(S, lo + chunk_steps)))
        routes = {}
        for side in SIDES:
            cols, routes[side] = _compose_side(part, tables, rank_times, wire, layout, side)
            for k, v in cols.items():
                sides[side][k][lo:lo + len(v)] = v
        slowest = sides["oblivious"]["slowest_rank"][lo:lo + part.num_steps]
        diff = routes["oblivious"] - routes["masked"]
        padded[lo:lo + part.num_steps] = diff.sum(axis=1)
        at = np.take_along_axis(diff, np.maximum(slowest, 0)[:, None], axis=1)[:, 0]
        to_slowest[lo:lo + part.num_steps] = np.where(slowest >= 0, at, 0)
    return EPColumns(sides, padded, to_slowest)


def _compose_side(calls: StepCalls, tables: SourceTables, rank_times, wire: WireModel, layout: EPStepLayout,
                  side: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(SideStep's scalar figures [S] of one side, routes to each rank summed over the micro-batches [S, R])."""
    S, R, epr = calls.num_steps, layout.ep_size, layout.local_experts
    present = calls.present
    zeros = np.zeros(S, dtype=np.float64)
    out = {"experts_us": zeros.copy(), "mean_rank_us": zeros.copy(), "dispatch_us": zeros.copy(),
           "combine_us": zeros.copy(), "dispatch_bytes": np.zeros(S, dtype=np.int64),
           "combine_bytes": np.zeros(S, dtype=np.int64), "slowest_rank": np.full(S, -1, dtype=np.int64),
           "slowest_us": zeros.copy()}
    routes = np.zeros((S, R), dtype=np.int64)
    parts = []
    for m in range(present.shape[1]):
        got = tables.gather(calls, m, side)
        counts = got["experts"].reshape(S * R, epr)
        times = np.asarray(rank_times.batch_array(counts, got["received"].reshape(S * R)),
                           dtype=np.float64).reshape(S, R)
        slowest = np.argmax(times, axis=1)
        top = times[np.arange(S), slowest]
        on = present[:, m]
        d_us = _phase_us(wire, wire.dispatch_overhead_us, got["out_intra"], got["in_intra"], got, layout.dispatch_row_bytes,
                         transpose=False)
        x_us = _phase_us(wire, wire.combine_overhead_us, got["out_intra"], got["in_intra"], got, layout.combine_row_bytes,
                         transpose=True)
        d_us, x_us, top_on = np.where(on, d_us, 0.0), np.where(on, x_us, 0.0), np.where(on, top, 0.0)
        parts.append((d_us, top_on, x_us, on))
        out["experts_us"] = out["experts_us"] + top_on
        out["mean_rank_us"] = out["mean_rank_us"] + np.where(on, _in_order_mean(times), 0.0)
        out["dispatch_us"] = out["dispatch_us"] + d_us
        out["combine_us"] = out["combine_us"] + x_us
        off_rows = np.where(on, got["out_off"].sum(axis=1), 0)
        out["dispatch_bytes"] += off_rows * layout.dispatch_row_bytes
        out["combine_bytes"] += off_rows * layout.combine_row_bytes
        routes += got["experts"].reshape(S, R, epr).sum(axis=2)
        newer = on & (top >= out["slowest_us"])
        out["slowest_rank"] = np.where(newer, slowest, out["slowest_rank"])
        out["slowest_us"] = np.where(newer, top, out["slowest_us"])
    out["step_us"] = _step_us(parts, layout.dbo)
    return out, routes


def _phase_us(wire: WireModel, overhead_us: float, out_intra, in_intra, got, row_bytes: int, transpose: bool
              ) -> np.ndarray:
    """One phase's time per step: overhead + the slowest rank's max(intra link, inter link) (WireModel.phase_us)."""
    out_inter = got["out_off"] - out_intra
    in_inter = got["received"] - got["own"] - in_intra
    if transpose:  # combine sends every received row back: the dispatch matrix transposed
        out_intra, in_intra, out_inter, in_inter = in_intra, out_intra, in_inter, out_inter
    b = float(row_bytes)
    rank_us = np.maximum(wire.intra.times_us(out_intra * b, in_intra * b), wire.inter.times_us(out_inter * b,
                                                                                               in_inter * b))
    return overhead_us + rank_us.max(axis=1)


def _step_us(parts, dbo: bool) -> np.ndarray:
    """ep_step.dbo_step_us over the present micro-batches: the overlap of two where both hold calls, else serial."""
    serial = None
    for d, c, x, on in parts:
        term = np.where(on, d + c + x, 0.0)
        serial = term if serial is None else serial + term
    if not (dbo and len(parts) == 2):
        return serial
    (d0, c0, x0, on0), (d1, c1, x1, on1) = parts
    overlapped = d0 + np.maximum(c0, d1) + np.maximum(x0, c1) + x1
    return np.where(on0 & on1, overlapped, serial)
