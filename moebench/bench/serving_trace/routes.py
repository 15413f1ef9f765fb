"""The routing of the EP step's source calls: every source slot's batch routed once (both sides read it), each
call's routes per expert and rows per EP rank counted off its slot's rows (StepRoutes)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from moebench.bench.serving_trace.ep_step import CallRoutes, EPStepLayout
from moebench.bench.serving_trace.shapes import shape_params
from moebench.inputs import make_batch, route
from moebench.inputs.engine_padding import StepPadding
from moebench.params import Params

SLOT_SEED = 104_729 * 7_919  # the source slots' batches: seed offsets past every single-rank shape's


class StepRoutes:
    """The routing of every source call of the steps, per side, from one routed batch per source slot.

    A call (rows, real) of slot s is the first `real` rows of slot s's real-token batch followed by rows - real
    padded rows (the producers' layout: real tokens at the head). Routing is per row, so the call's routes are the
    prefix's plus its padding's: routed once per slot, then counted per call (the padding, oblivious only: masked
    padded rows route nowhere). The padded rows are what padding_fill makes them: zeros (the same router input on
    every source), repeat (copies of the call's first real row: row 0 of the slot's batch), random / stale (rows of
    a second batch per slot). One selection bias for every source (slot 0's): it is the model's, not a source's."""

    def __init__(self, p: Params, device, layout: EPStepLayout):
        self.p, self.device, self.layout = p, device, layout
        self.slots: dict[int, tuple] = {}  # slot -> (real ids, real rank hits, pad ids, pad rank hits)
        self.cache: dict[tuple[int, int, int], dict] = {}
        self.bias = None

    def _routed(self, sp: Params, batch) -> tuple:
        batch = dataclasses.replace(batch, bias=self.bias)
        _, ids = route(sp, batch, use_mask=False)
        ids = ids.to(torch.int64).cpu()
        lay = self.layout
        hits = torch.zeros(ids.shape[0], lay.ep_size + 1, dtype=torch.bool)
        hits.scatter_(1, torch.where(ids >= 0, ids // lay.local_experts, lay.ep_size), True)
        return ids, hits[:, :lay.ep_size]

    def _route_slot(self, slot: int, rows: int) -> None:
        sp = shape_params(self.p, rows, rows)
        real = make_batch(sp, self.device, need_hidden=False, seed_offset=SLOT_SEED * (slot + 1))
        if self.bias is None:
            self.bias = real.bias
        real_ids, real_hits = self._routed(sp, real)
        if self.p.padding_fill == "repeat":
            pad_ids, pad_hits = real_ids[:1].expand(rows, -1), real_hits[:1].expand(rows, -1)
        else:
            pad = make_batch(shape_params(self.p, rows, 0), self.device, need_hidden=False,
                             seed_offset=SLOT_SEED * (slot + 1) + 1)
            pad_ids, pad_hits = self._routed(shape_params(self.p, rows, 0), pad)
        self.slots[slot] = (real_ids, real_hits, pad_ids, pad_hits)

    def prepare(self, steps: Sequence[StepPadding], progress: Callable[[int, int], None] | None = None) -> int:
        """Route every slot the steps' calls need, at the most rows any of its calls has; returns the slots routed."""
        lay = self.layout
        rows: dict[int, int] = {}
        for s in steps:
            for c in s.calls:
                for q in range(lay.replicas):
                    slot = lay.slot(q, len(s.real), c.dp_rank, c.sp_rank)
                    rows[slot] = max(rows.get(slot, 0), c.rows)
        todo = sorted(k for k in rows if k not in self.slots or self.slots[k][0].shape[0] < rows[k])
        for i, slot in enumerate(todo):
            self._route_slot(slot, rows[slot])
            if progress:
                progress(i + 1, len(todo))
        if todo:
            self.cache.clear()
        return len(todo)

    def __call__(self, rows: int, real: int, slot: int, side: str) -> CallRoutes:
        key = (rows, real, slot)
        if key not in self.cache:
            real_ids, real_hits, pad_ids, pad_hits = self.slots[slot]
            E = self.p.num_experts
            ids, hits = real_ids[:real], real_hits[:real]
            masked = CallRoutes(tuple(torch.bincount(ids[ids >= 0], minlength=E).tolist()),
                                tuple(hits.sum(dim=0).tolist()))
            ids = torch.cat([ids, pad_ids[:rows - real]])
            hits = torch.cat([hits, pad_hits[:rows - real]])
            oblivious = CallRoutes(tuple(torch.bincount(ids[ids >= 0], minlength=E).tolist()),
                                   tuple(hits.sum(dim=0).tolist()))
            self.cache[key] = {"masked": masked, "oblivious": oblivious}
        return self.cache[key][side]
