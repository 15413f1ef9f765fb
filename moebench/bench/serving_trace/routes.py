"""The routing of the EP step's source calls: every source slot's batch routed once (both sides read it), each
call's routes per expert and rows per EP rank counted off its slot's rows (StepRoutes)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.ep_step import CallRoutes, EPStepLayout
from moebench.bench.serving_trace.step_calls import StepCalls
from moebench.bench.serving_trace.shape_streams import SLOT_SEED, routing_bias, shape_params, stream_size
from moebench.inputs import make_batch, route
from moebench.inputs.engine_padding import StepPadding
from moebench.params import Params



class StepRoutes:
    """The routing of every source call of the steps, per side, from one routed batch per source slot.

    A call (rows, real) of slot s is the first `real` rows of slot s's real-token batch followed by rows - real
    padded rows (the producers' layout: real tokens at the head). Routing is per row, so the call's routes are the
    prefix's plus its padding's: routed once per slot, then counted per call (the padding, oblivious only: masked
    padded rows route nowhere). The padded rows are what padding_fill makes them: zeros (the same router input on
    every source), repeat (copies of the call's first real row: row 0 of the slot's batch), random / stale (rows of
    a second batch per slot). One selection bias for every source (shape_streams.routing_bias): it is the model's,
    not a source's. Slot 0's batches are the single-rank view's streams (shape_streams): that rank's calls route
    alike in both views.
    Each batch is kept as prefix sums (routes to each expert and rows to each EP rank over its first n rows, int32),
    so a call is counted in O(experts), not O(rows): a trace of 10^5 distinct steps reads them 10^6 times."""

    def __init__(self, p: Params, device, layout: EPStepLayout):
        self.p, self.device, self.layout = p, device, layout
        self.slots: dict[int, tuple] = {}  # slot -> (rows, real prefix sums, pad prefix sums: (experts, ranks))
        self.cache: dict[tuple[int, int, int], dict] = {}
        self.bias = routing_bias(p, device)

    def _routed(self, sp: Params, batch) -> torch.Tensor:
        batch = dataclasses.replace(batch, bias=self.bias)
        _, ids = route(sp, batch, use_mask=False)
        return ids.to(torch.int64).cpu()

    def _prefix_sums(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(int32 [n + 1, E] routes to each expert, int32 [n + 1, R] rows to each EP rank) over the first n rows."""
        lay, n = self.layout, ids.shape[0]
        E = self.p.num_experts
        valid = ids >= 0
        per_expert = torch.zeros(n, E + 1, dtype=torch.int32)
        per_expert.scatter_add_(1, torch.where(valid, ids, E), torch.ones_like(ids, dtype=torch.int32))
        hits = torch.zeros(n, lay.ep_size + 1, dtype=torch.int32)
        hits.scatter_(1, torch.where(valid, ids // lay.local_experts, lay.ep_size), 1)
        out = []
        for per_row in (per_expert[:, :E], hits[:, :lay.ep_size]):
            table = np.zeros((n + 1, per_row.shape[1]), dtype=np.int32)
            np.cumsum(per_row.numpy(), axis=0, out=table[1:])
            out.append(table)
        return out[0], out[1]

    def _route_slot(self, slot: int, real_rows: int, pad_rows: int) -> None:
        sp = shape_params(self.p, real_rows, real_rows)
        real = make_batch(sp, self.device, need_hidden=False, seed_offset=SLOT_SEED * (slot + 1))
        real_ids = self._routed(sp, real)
        if self.p.padding_fill == "repeat":
            pad_ids = real_ids[:1].expand(pad_rows, -1)
        elif self.p.padding_fill == "zeros":  # every padded row the same zero row: routed once (routing is per row)
            one = make_batch(shape_params(self.p, 1, 0), self.device, need_hidden=False,
                             seed_offset=SLOT_SEED * (slot + 1) + 1)
            pad_ids = self._routed(shape_params(self.p, 1, 0), one).expand(pad_rows, -1)
        else:
            pad = make_batch(shape_params(self.p, pad_rows, 0), self.device, need_hidden=False,
                             seed_offset=SLOT_SEED * (slot + 1) + 1)
            pad_ids = self._routed(shape_params(self.p, pad_rows, 0), pad)
        self.slots[slot] = ((real_rows, pad_rows), self._prefix_sums(real_ids), self._prefix_sums(pad_ids))

    def prepare(self, steps: Sequence[StepPadding], progress: Callable[[int, int], None] | None = None) -> int:
        """Route every slot the steps' calls need: its real batch at the most real tokens of its calls, its padding at
        the most padded rows (or that, whichever is more), each a power of two (stream_size: the capture list of a
        what-if axis leaves a slot's real rows where they were); returns the slots routed."""
        need: dict[int, tuple[int, int]] = {}
        self._steps_need(need, steps)
        return self._route_needs(need, progress)

    def _steps_need(self, need: dict[int, tuple[int, int]], steps: Sequence[StepPadding]) -> None:
        for s in steps:
            for c in s.calls:
                for q in range(self.layout.replicas):
                    _need(need, self.layout.slot(q, len(s.real), c.dp_rank, c.sp_rank), c.real, c.rows - c.real)

    def prepare_calls(self, calls: StepCalls, steps: Sequence[StepPadding] = (),
                      progress: Callable[[int, int], None] | None = None) -> int:
        """prepare() for the steps of `calls` (step_calls' arrays: the most real and padded rows of each source
        read off them at once) and `steps`."""
        need: dict[int, tuple[int, int]] = {}
        dp_size = calls.real_tokens.shape[1]
        if calls.num_steps:
            real = calls.real.max(axis=(0, 2))  # [DP, SP]
            pad = (calls.rows - calls.real).max(axis=(0, 2))
            for d in range(dp_size):
                for j in range(self.layout.sp_size):
                    for q in range(self.layout.replicas):
                        _need(need, self.layout.slot(q, dp_size, d, j), int(real[d, j]), int(pad[d, j]))
        self._steps_need(need, steps)
        return self._route_needs(need, progress)

    def _route_needs(self, need: dict[int, tuple[int, int]], progress) -> int:
        sizes = {k: (stream_size(r), stream_size(max(r, p))) for k, (r, p) in need.items()}
        todo = sorted(k for k in sizes if k not in self.slots or self.slots[k][0][0] < sizes[k][0]
                      or self.slots[k][0][1] < sizes[k][1])
        for i, slot in enumerate(todo):
            self._route_slot(slot, *sizes[slot])
            if progress:
                progress(i + 1, len(todo))
        if todo:
            self.cache.clear()
        return len(todo)

    def __call__(self, rows: int, real: int, slot: int, side: str) -> CallRoutes:
        key = (rows, real, slot)
        if key not in self.cache:
            _, (real_experts, real_ranks), (pad_experts, pad_ranks) = self.slots[slot]
            masked = CallRoutes(tuple(real_experts[real].tolist()), tuple(real_ranks[real].tolist()))
            oblivious = CallRoutes(tuple((real_experts[real] + pad_experts[rows - real]).tolist()),
                                   tuple((real_ranks[real] + pad_ranks[rows - real]).tolist()))
            self.cache[key] = {"masked": masked, "oblivious": oblivious}
        return self.cache[key][side]


def _need(need: dict[int, tuple[int, int]], slot: int, real: int, pad: int) -> None:
    """A slot's most real and padded rows so far, at least 1 each."""
    have = need.get(slot, (1, 1))
    need[slot] = (max(have[0], real), max(have[1], pad))
