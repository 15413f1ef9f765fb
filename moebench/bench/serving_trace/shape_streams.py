"""Every padded shape of a serving trace from two routed streams: the rows, the routing figures and the features of
a shape as prefix sums, with no batch made or routed per shape.

A shape (rows, real) is a layer call whose first `real` rows are real tokens and whose other rows are padding. Its
rows are the first `real` rows of the REAL stream (one seeded batch of real tokens at the largest real count of the
trace: source slot 0's, so this rank's calls are the EP step's source 0) followed by rows - real padded rows: copies of the real stream's row 0 for `padding_fill: repeat` (the
call's first real row; for a call with no real token, the row the fill would copy is an equally random draw), else
the first rows of the PAD stream (one seeded batch of padded rows at the largest padding, filled by make_batch as
the fill says: zeros, random or stale). Routing is per row, so each stream is routed once (with routing_bias, the
bias every source shares) and a shape's routes are the prefixes' sums:

  masked     the real prefix alone (padded rows route nowhere)
  oblivious  the real prefix plus the pad prefix

held as cumulative counts per row of: routes to each of this rank's local experts (the EP layout's rank 0, the
rank the single-rank view times), routes to each EP rank, and rows with a route to each EP rank. A trace of a
million steps has tens of thousands of shapes; their figures are a gather over these tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.record import SIDES
from moebench.params import EPLayout, Params

SLOT_SEED = 104_729 * 7_919  # source slot s's real batch: offset SLOT_SEED * (s + 1), its padding's one more
BIAS_SEED = 104_723  # the routing's selection bias: drawn apart, so no stream's length moves it


def stream_size(rows: int) -> int:
    """A stream's rows for a need of `rows`: a power of two (a stream's values depend on its length on a GPU)."""
    return 1 << max(0, rows - 1).bit_length()


def routing_bias(p: Params, device):
    """The selection bias every source's routing uses (None without one): the model's, not a source's, and the same
    whatever the streams' lengths (make_batch draws a batch's bias after its rows)."""
    from moebench.inputs import make_batch

    return make_batch(shape_params(p, 1, 1), device, need_hidden=False, seed_offset=BIAS_SEED).bias


def shape_params(p: Params, rows: int, real: int) -> Params:
    """The layer point of one shape: `rows` rows, the trailing rows - real of them padding."""
    if not 0 <= real <= rows or rows < 1:
        raise ValueError(f"shape ({rows}, {real}): need 0 <= real <= rows and rows >= 1")
    # rows * ((rows - real) / rows) is within an ulp of rows - real, so padding_rows() rounds back to it exactly
    return replace(p, num_tokens=rows, padding_producer="ratio", padding_ratio=(rows - real) / rows, mask=True,
                   trace=None, trace_file=None)


def _cumulative(per_row: np.ndarray) -> np.ndarray:
    """[n, D] counts per row -> int64 [n + 1, D] prefix sums (row 0: nothing)."""
    out = np.zeros((per_row.shape[0] + 1, per_row.shape[1]), dtype=np.int64)
    np.cumsum(per_row, axis=0, out=out[1:])
    return out


def _tables(ids: torch.Tensor, layout: EPLayout) -> dict[str, np.ndarray]:
    """Cumulative per-row tables of a stream's routing ids [n, K] (-1: none)."""
    ids = ids.to(torch.int64).cpu()
    n = ids.shape[0]
    valid = ids >= 0
    local = valid & (ids < layout.local_experts)
    per_expert = torch.zeros(n, layout.local_experts + 1, dtype=torch.int64)
    per_expert.scatter_add_(1, torch.where(local, ids, layout.local_experts), torch.ones_like(ids))
    rank = torch.where(valid, ids // layout.local_experts, layout.ep_size)
    per_rank = torch.zeros(n, layout.ep_size + 1, dtype=torch.int64)
    per_rank.scatter_add_(1, rank, torch.ones_like(ids))
    hits = torch.zeros(n, layout.ep_size + 1, dtype=torch.bool)
    hits.scatter_(1, rank, True)
    return {"local_counts": _cumulative(per_expert[:, :-1].numpy()),
            "rank_routes": _cumulative(per_rank[:, :-1].numpy()),
            "rank_rows": _cumulative(hits[:, :-1].to(torch.int64).numpy()),
            "any_route": _cumulative(valid.any(dim=1, keepdim=True).to(torch.int64).numpy())}


class ShapeStreams:
    """The two routed streams of one layer point, at least `max_real` real and `max_pad` padded rows."""

    def __init__(self, p: Params, device: torch.device, max_real: int, max_pad: int):
        from moebench.inputs import make_batch, route

        self.p, self.device = p, device
        self.layout = EPLayout.of(p)
        n_real, n_pad = max(1, max_real), max(1, max_pad)
        sp_real = shape_params(p, n_real, n_real)
        self.real = dataclasses.replace(make_batch(sp_real, device, seed_offset=SLOT_SEED),
                                        bias=routing_bias(p, device))
        _, real_ids = route(sp_real, self.real, use_mask=False)
        if p.padding_fill == "repeat":
            self.pad = dataclasses.replace(
                self.real, logits=self.real.logits[:1].expand(n_pad, -1),
                hidden=None if self.real.hidden is None else self.real.hidden[:1].expand(n_pad, -1))
            pad_ids = real_ids[:1].expand(n_pad, -1)
        else:
            sp_pad = shape_params(p, n_pad, 0)
            self.pad = dataclasses.replace(make_batch(sp_pad, device, seed_offset=SLOT_SEED + 1), bias=self.real.bias)
            _, pad_ids = route(sp_pad, dataclasses.replace(self.pad, mask=None), use_mask=False)
        self.real_tables, self.pad_tables = _tables(real_ids, self.layout), _tables(pad_ids, self.layout)
        self.max_real, self.max_pad = n_real, n_pad

    def batch(self, rows: int, real: int):
        """(the shape's layer point, its batch): the real prefix and the pad prefix, is_padding on the latter."""
        from moebench.inputs.router_mask import point_masks

        if not 0 <= real <= rows or real > self.max_real or rows - real > self.max_pad:
            raise ValueError(f"shape ({rows}, {real}) outside the streams ({self.max_real} real, {self.max_pad} pad)")
        sp = shape_params(self.p, rows, real)

        def joined(a, b):
            return None if a is None else torch.cat([a[:real], b[:rows - real]]).contiguous()

        is_padding, mask = point_masks(sp, self.device)
        return sp, dataclasses.replace(self.real, logits=joined(self.real.logits, self.pad.logits),
                                       hidden=joined(self.real.hidden, self.pad.hidden), is_padding=is_padding,
                                       mask=mask)

    def counts(self, table: str, rows: Sequence[int] | np.ndarray, real: Sequence[int] | np.ndarray, side: str
               ) -> np.ndarray:
        """[S, D] cumulative `table` counts of shapes (rows[i], real[i]) on one side."""
        rows, real = np.asarray(rows, dtype=np.int64), np.asarray(real, dtype=np.int64)
        got = self.real_tables[table][real]
        if side == "oblivious":
            got = got + self.pad_tables[table][rows - real]
        return got

    def figures_many(self, rows, real) -> dict[str, dict[str, np.ndarray]]:
        """The routing figures of shapes (rows[i], real[i]) per side, as shapes.routing_figures gives them for a
        routed batch: {side: {"padding_gemm_rows": int64 [S], "rank_loads": int64 [S, R], "max_rows_per_rank":
        int64 [S]}}."""
        rows, real = np.asarray(rows, dtype=np.int64), np.asarray(real, dtype=np.int64)
        out = {}
        for side in SIDES:
            gemm = (self.pad_tables["local_counts"][rows - real].sum(axis=1) if side == "oblivious"
                    else np.zeros(len(rows), dtype=np.int64))
            if self.layout.ep_size == 1:
                most = self.counts("any_route", rows, real, side)[:, 0]
            else:
                most = self.counts("rank_rows", rows, real, side).max(axis=1)
            out[side] = {"padding_gemm_rows": gemm, "rank_loads": self.counts("rank_routes", rows, real, side),
                         "max_rows_per_rank": most}
        return out

    def figures(self, rows: int, real: int) -> tuple[dict[str, int], dict[str, list[int]], dict[str, int]]:
        """One shape's routing figures per side: (padding_gemm_rows, rank_loads, max_rows_per_rank)."""
        got = self.figures_many([rows], [real])
        return ({side: int(got[side]["padding_gemm_rows"][0]) for side in SIDES},
                {side: got[side]["rank_loads"][0].tolist() for side in SIDES},
                {side: int(got[side]["max_rows_per_rank"][0]) for side in SIDES})
