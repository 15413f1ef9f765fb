"""`a2a_fixed`: fixed-capacity all-to-all, no host synchronisation, CUDA-graph capturable.

Every rank sends a block of `capacity` rows to every rank (block d of the send buffer goes to rank d). The first
`count` rows of a block are real; the rest are whatever the buffer held (uninitialised: torch.empty) and travel
too. The per-destination counts are exchanged on the device beside the rows; the receiver neutralises the rows
past each source's count with `globalize_recv_topk_idx` (ids are sent as destination-local values and validated
on receipt, offset 0 and bound E/R), so garbage, including valid-looking ids, can never be routed.

One step: `plan_sends` (two Triton launches: slots, capped counts, overflow flag) -> the pack kernel (rows and their
routing into one wire row each, moebench.dispatch.permute.RowLayout), with the count exchange beside it on a side
stream -> ONE all_to_all_single of the wire rows -> ids copied out and neutralised. Combine: one all_to_all_single
back, then one kernel sums each row's returned partial outputs by (row, destination) slot, in destination order
(deterministic, no atomics). Under CUDA-graph capture everything runs in stream order.

`capacity` is a compile-time constant (tl.constexpr) of the pack and combine kernels (moebench.dispatch.pack):
each distinct capacity is one Triton compilation, which is the recompile cost the capacity policies (exact / pow2
/ max, the point's `capacity_policy`; `from_point` applies it to the step's max rows per rank pair) trade against wasted
bandwidth. A (source, destination) pair with more rows than the capacity raises an on-device overflow flag
(never silently accepted): `overflowed()` reads it, outside timed regions, and the benchmark's check fails on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.check import CheckResult
from moebench.dispatch.base import (
    Dispatched,
    DispatchPath,
    EPLayout,
    ReceivedRows,
    dispatch_path,
    effective_ids,
    token_in_rank,
)
from moebench.dispatch.comm import SideStream, all_to_all_single, max_over_ranks, triton_default
from moebench.dispatch.pack import (CapacityKnobs, capacity_for, combine_fixed, combine_fixed_torch, pack_fixed,
                                   pack_fixed_torch)
from moebench.dispatch.permute import RowLayout, plan_scratch, run_plan
from moebench.kernels.contract import check_mask


def max_rows_per_pair(topk_ids: torch.Tensor, is_padding: torch.Tensor | None, layout: EPLayout) -> int:
    """The step's max rows any rank sends to any rank (all_reduce MAX; a host sync, for set-up only)."""
    in_rank = token_in_rank(effective_ids(topk_ids, is_padding), layout)
    mx = in_rank.sum(0).max().reshape(1).to(torch.int64) if in_rank.numel() else \
        torch.zeros(1, dtype=torch.int64, device=topk_ids.device)
    return max_over_ranks(mx, layout.group, layout.ep_size)


def neutralise_blocks(recv_ids: torch.Tensor, recv_counts: torch.Tensor, capacity: int, local_experts: int,
                      use_triton: bool) -> torch.Tensor:
    """In place on [R*capacity, K] local ids: per source block, rows >= its count and ids outside
    [0, local_experts) become -1 (globalize_recv_topk_idx with offset 0, bound E/R: local ids validated)."""
    from moebench.kernels.globalize_recv_topk_idx import globalize_recv_topk_idx, globalize_recv_topk_idx_torch

    fn = globalize_recv_topk_idx if use_triton else globalize_recv_topk_idx_torch
    R = recv_counts.shape[0]
    for s in range(R):
        fn(recv_ids[s * capacity:(s + 1) * capacity], recv_counts[s:s + 1], 0, local_experts)
    return recv_ids


@dataclass
class FixedHandle:
    send_pos: torch.Tensor  # int32 [T, R] (the path's buffer: valid until its next dispatch)
    num_tokens: int


@dispatch_path("a2a_fixed", description="fixed-capacity blocks per destination (capacity_policy), no host sync, "
                                         "graph-capturable; Triton pack/combine with CAPACITY constexpr; garbage "
                                         "rows neutralised on receipt")
class A2AFixedPath(DispatchPath):
    receives = "token"
    graph_capturable = True
    buffers_sized_by_max_tokens = True  # the capacity may not pass num_max_tokens_per_rank

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, num_tokens: int, capacity: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 use_triton: bool | None = None, max_rows_per_pair: int | None = None):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.max_rows_per_pair = max_rows_per_pair  # what the capacity was sized for (None: given by hand)
        self.num_tokens = int(num_tokens)
        self.use_triton = triton_default(self.device) if use_triton is None else use_triton
        R, K, dev = layout.ep_size, top_k, self.device
        rows = R * self.capacity
        self.rows = RowLayout(hidden, top_k, dtype)
        # Allocated once; never cleared: rows past the counts keep whatever memory held (that is the point).
        self.send_buf = self.rows.empty(rows, dev)
        self.recv_buf = self.rows.empty(rows, dev)
        self.send_x, self.send_meta = self.rows.x(self.send_buf), self.rows.meta(self.send_buf)
        self.recv_x, self.recv_meta = self.rows.x(self.recv_buf), self.rows.meta(self.recv_buf)
        self.recv_ids = torch.empty(rows, K, dtype=torch.int32, device=dev)
        self.counts = torch.zeros(2, R, dtype=torch.int32, device=dev)  # [0]: sent per destination, [1]: received
        self.send_counts, self.recv_counts = self.counts[0], self.counts[1]
        self.offsets = torch.zeros(R, dtype=torch.int32, device=dev)  # written by the plan, unused by fixed blocks
        self.send_pos = torch.empty(self.num_tokens, R, dtype=torch.int32, device=dev)
        self.back = torch.empty(rows, hidden, dtype=dtype, device=dev)
        self.overflow = torch.zeros(1, dtype=torch.int32, device=dev)  # sticky until reset_overflow()
        self.plan_scratch = plan_scratch(self.num_tokens, top_k, R, dev)  # no allocation under graph capture
        self.side = SideStream(self.device)

    @classmethod
    def from_point(cls, layout, p, topk_ids, is_padding, device) -> "A2AFixedPath":
        """The capacity the point's capacity_policy gives for this step's max rows per rank pair over every rank (a
        collective), within its num_max_tokens_per_rank (CapacityKnobs)."""
        max_rows = max_rows_per_pair(topk_ids, is_padding, layout)
        cap = p.knobs(CapacityKnobs)
        capacity = capacity_for(cap.capacity_policy, max_rows, cap.num_max_tokens_per_rank)
        return cls(layout, hidden=p.hidden, top_k=p.top_k, num_tokens=topk_ids.shape[0], capacity=capacity,
                   dtype=torch.bfloat16, device=device, max_rows_per_pair=max_rows)

    def prepare_check(self, generator: torch.Generator) -> None:
        self.fill_garbage(generator)
        self.reset_overflow()

    def extra_checks(self, d: Dispatched) -> list[CheckResult]:
        results = []
        if not self.invalid_rows_clean():
            results.append(CheckResult(False, "a2a_fixed: receive rows past the counts kept live ids", {}))
        if self.overflowed():
            results.append(CheckResult(False, f"capacity {self.capacity} overflowed (max rows per rank pair "
                                              f"{self.max_rows_per_pair})", {}))
        return results

    def record_info(self, p) -> dict:
        cap = p.knobs(CapacityKnobs)
        return {"capacity": self.capacity, "capacity_policy": cap.capacity_policy,
                "max_rows_per_pair": self.max_rows_per_pair, "buffer_rows": cap.num_max_tokens_per_rank}

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        R, cap = lay.ep_size, self.capacity
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"a2a_fixed was built for {self.num_tokens} rows, got {x.shape[0]}")
        check_mask(is_padding, x.shape[0])
        run_plan(self.use_triton, topk_ids, is_padding, lay, cap, self.send_pos, self.send_counts, self.offsets,
                 self.overflow, self.plan_scratch)
        self._mark("plan")
        self.side.fork_here()
        pack = pack_fixed if self.use_triton else pack_fixed_torch
        pack(x, self.send_pos, topk_ids, topk_weights, self.send_x, self.send_meta, cap, lay.local_experts)
        self._mark("pack")
        with self.side.run():  # the count exchange overlaps the pack (it needs the plan only)
            all_to_all_single(self.recv_counts, self.send_counts, group=lay.group, world_size=R)
            self._mark("count_exchange")
        self.side.join()
        all_to_all_single(self.recv_buf, self.send_buf, group=lay.group, world_size=R)
        self._mark("payload_a2a")
        self.recv_ids.copy_(self.rows.ids(self.recv_buf))
        neutralise_blocks(self.recv_ids, self.recv_counts, cap, lay.local_experts, self.use_triton)
        self._mark("unpack")
        return Dispatched(recv_x=self.recv_x, recv_topk_ids=self.recv_ids,
                          recv_topk_weights=self.rows.weights(self.recv_buf), num_recv=self.recv_counts,
                          handle=FixedHandle(self.send_pos, x.shape[0]), send_counts=self.send_counts,
                          recv_counts=self.recv_counts)

    def combine(self, expert_out, handle: FixedHandle, out=None):
        lay = self.layout
        if out is None:
            out = torch.empty(handle.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                              device=expert_out.device)
        back = self.back if self.back.dtype == expert_out.dtype else torch.empty_like(expert_out)
        all_to_all_single(back, expert_out.contiguous(), group=lay.group, world_size=lay.ep_size)
        self._mark("payload_a2a")
        (combine_fixed if self.use_triton else combine_fixed_torch)(back, handle.send_pos, out, self.capacity)
        self._mark("reduce")
        return out

    # -- checks and accounting (host syncs) ----------------------------------------------------------------------
    def fill_garbage(self, generator: torch.Generator) -> None:
        """Make every buffer look like stale memory: NaN rows and routing that looks valid (local ids in
        [-1, E/R), plausible weights and source rows), so that only the counts can tell real rows from garbage."""
        E_loc, K, T = self.layout.local_experts, self.top_k, max(self.num_tokens, 1)
        dev = self.device
        for buf in (self.send_x, self.recv_x, self.back):
            buf.fill_(float("nan"))
        for meta in (self.send_meta, self.recv_meta):
            rows = meta.shape[0]
            meta[:, :K] = torch.randint(-1, E_loc, (rows, K), generator=generator, device=dev, dtype=torch.int32)
            meta[:, K:2 * K] = torch.rand(rows, K, generator=generator, device=dev).view(torch.int32)
            meta[:, 2 * K] = torch.randint(0, T, (rows,), generator=generator, device=dev, dtype=torch.int32)
        self.recv_ids.copy_(self.recv_meta[:, :K])

    def invalid_rows_clean(self) -> bool:
        """Every receive row past its source's count has only -1 ids (the neutralisation worked)."""
        return bool((self.recv_ids[~self.valid_rows()] == -1).all())

    def overflowed(self) -> bool:
        return bool(self.overflow.item())

    def reset_overflow(self) -> None:
        self.overflow.zero_()

    def valid_rows(self) -> torch.Tensor:
        """bool [R*capacity]: rows below their source block's count."""
        R, cap = self.layout.ep_size, self.capacity
        within = torch.arange(cap, device=self.device).unsqueeze(0) < self.recv_counts.to(torch.int64).unsqueeze(1)
        return within.reshape(R * cap)

    def received(self, d: Dispatched) -> ReceivedRows:
        rows = self.valid_rows().nonzero(as_tuple=True)[0]
        return ReceivedRows(row_index=rows, src_rank=rows // self.capacity,
                            src_row=self.recv_meta[rows, 2 * self.top_k].to(torch.int64))

    def wire_recv_rows(self, d: Dispatched) -> int:
        return self.layout.ep_size * self.capacity

    def wire_row_bytes(self) -> int:
        return self.rows.row_bytes
