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

`capacity` is a compile-time constant (tl.constexpr) of the pack and combine kernels: each distinct capacity is
one Triton compilation, which is the recompile cost the capacity policies (exact / pow2 / max) trade against
wasted bandwidth. A (source, destination) pair with more rows than the capacity raises an on-device overflow flag
(never silently accepted): `overflowed()` reads it, outside timed regions. The same two kernels with CAPACITY = 0
serve the exact-size `a2a` path: block d then starts at a device offset (the exclusive prefix of the counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.dispatch.base import (DispatchPath, Dispatched, EPLayout, ReceivedRows, SideStream,
                                    all_to_all_single)
from moebench.dispatch.permute import RowLayout, plan_scratch, plan_sends, plan_sends_torch
from moebench.kernels._details.jit import check_triton_device, interpreting, next_pow2
from moebench.kernels._details.args import check_mask

BLOCK_H = 1024  # hidden columns per program: 2 KB of bf16 (one 16-byte vector per thread), 7 programs per 7168
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------------------------
# Send positions (torch, sync-free; the Triton plan is moebench.dispatch.permute.plan_sends)
# ---------------------------------------------------------------------------------------------------------------

def send_positions(in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(send_pos int32 [T, R], counts int32 [R]): row t's slot in destination d's block (-1: not sent), in
    ascending row order; counts before any capacity cut."""
    flags = in_rank.to(torch.int32)
    pos = torch.cumsum(flags, dim=0, dtype=torch.int32) - 1
    send_pos = torch.where(in_rank, pos, torch.full_like(pos, -1)).contiguous()
    return send_pos, flags.sum(0, dtype=torch.int32)


def _slots(send_pos: torch.Tensor, capacity: int, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok bool [T, R], slot int64 [T, R]) of every (row, destination) pair: capacity > 0: block d at rows
    [d*capacity, (d+1)*capacity), pairs at or past the capacity dropped; capacity == 0: block d at offsets[d]."""
    T, R = send_pos.shape
    pos = send_pos.to(torch.int64)
    if capacity > 0:
        start = torch.arange(R, device=send_pos.device, dtype=torch.int64) * capacity
        ok = (pos >= 0) & (pos < capacity)
    else:
        if offsets is None:
            raise ValueError("capacity 0 (exact blocks) needs the block offsets")
        start = offsets.to(torch.int64)
        ok = pos >= 0
    return ok, start.unsqueeze(0) + pos


# ---------------------------------------------------------------------------------------------------------------
# Pack: rows (and their routing) into the send blocks
# ---------------------------------------------------------------------------------------------------------------

def pack_fixed_torch(x: torch.Tensor, send_pos: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, experts_per_rank: int, *,
                     offsets: torch.Tensor | None = None) -> None:
    """Reference. For each (row t, destination d) with a slot s (see `_slots`): send_x[s] = x[t];
    send_meta[s] = [ids local to d (-1 where not d's), weights' fp32 bits, t].
    Slots nobody writes keep their previous content (uninitialised memory)."""
    K = topk_ids.shape[1]
    ok, slot_of = _slots(send_pos, capacity, offsets)
    t_idx, d_idx = ok.nonzero(as_tuple=True)
    slot = slot_of[t_idx, d_idx]
    send_x[slot] = x[t_idx]
    g = topk_ids[t_idx].to(torch.int64)
    loc = g - (d_idx.to(torch.int64) * experts_per_rank).unsqueeze(1)
    loc = torch.where((g >= 0) & (loc >= 0) & (loc < experts_per_rank), loc, torch.full_like(loc, -1))
    send_meta[slot, :K] = loc.to(torch.int32)
    send_meta[slot, K:2 * K] = topk_weights[t_idx].to(torch.float32).contiguous().view(torch.int32)
    send_meta[slot, 2 * K] = t_idx.to(torch.int32)


@triton.jit
def _pack_fixed_kernel(x_ptr, stride_x, send_pos_ptr, offsets_ptr, ids_ptr, stride_ids, w_ptr, stride_w,
                       send_x_ptr, stride_sx, send_meta_ptr, stride_sm, H, experts_per_rank, R: tl.constexpr,
                       R_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, CAPACITY: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    ds = tl.arange(0, R_PAD)
    d_ok = ds < R
    pos = tl.load(send_pos_ptr + t * R + ds, mask=d_ok, other=-1)
    if CAPACITY > 0:
        ok = (pos >= 0) & (pos < CAPACITY)  # past CAPACITY: dropped here, flagged by plan_sends
        start = ds * CAPACITY
    else:
        ok = pos >= 0
        start = tl.load(offsets_ptr + ds, mask=d_ok, other=0)
    slot = (start + pos).to(tl.int64)  # [R_PAD]
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    # a row sent nowhere (padding) is not even read; the flag is splat: the interpreter wants vector masks
    sent = (tl.zeros([BLOCK_H], dtype=tl.int32) + tl.max(ok.to(tl.int32), axis=0)) > 0
    row = tl.load(x_ptr + t * stride_x + cols, mask=cmask & sent)
    # read once, written to every destination it goes to: one [R_PAD, BLOCK_H] store
    tl.store(send_x_ptr + slot[:, None] * stride_sx + cols[None, :], tl.broadcast_to(row[None, :], [R_PAD, BLOCK_H]),
             mask=ok[:, None] & cmask[None, :])
    if hb == 0:  # the routing once per (row, destination)
        ks = tl.arange(0, K_PAD)
        kmask = ks < K
        g = tl.load(ids_ptr + t * stride_ids + ks, mask=kmask, other=-1)  # in its own dtype (int32/int64)
        w = tl.load(w_ptr + t * stride_w + ks, mask=kmask, other=0.0)
        loc = g[None, :] - (ds * experts_per_rank)[:, None]  # [R_PAD, K_PAD]: local to each destination
        loc = tl.where((g[None, :] >= 0) & (loc >= 0) & (loc < experts_per_rank), loc, -1).to(tl.int32)
        meta = send_meta_ptr + slot[:, None] * stride_sm + ks[None, :]
        m2 = ok[:, None] & kmask[None, :]
        tl.store(meta, loc, mask=m2)
        tl.store(meta + K, tl.broadcast_to(w.to(tl.int32, bitcast=True)[None, :], [R_PAD, K_PAD]), mask=m2)
        tl.store(send_meta_ptr + slot * stride_sm + 2 * K, tl.zeros([R_PAD], dtype=tl.int32) + t.to(tl.int32),
                 mask=ok)  # source row


def pack_fixed(x: torch.Tensor, send_pos: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, experts_per_rank: int, *,
               offsets: torch.Tensor | None = None, kernel=None) -> None:
    """Triton: same contract as pack_fixed_torch. CAPACITY is a constexpr: one compile per distinct capacity
    (0: exact blocks at `offsets`, the a2a path). send_x / send_meta may be strided views (rows contiguous), e.g.
    the two parts of a RowLayout buffer. `kernel`: a fresh JIT copy of _pack_fixed_kernel (jit_trace counts
    compiles from an empty in-memory cache)."""
    T, R = send_pos.shape
    K = topk_ids.shape[1]
    H = x.shape[1]
    if T == 0:
        return
    if capacity == 0 and offsets is None:
        raise ValueError("pack_fixed: capacity 0 (exact blocks) needs the block offsets")
    check_triton_device(x, send_x, send_meta, send_pos, topk_ids)
    if x.stride(1) != 1 or send_x.stride(1) != 1 or send_meta.stride(1) != 1 or not send_pos.is_contiguous():
        raise ValueError("pack_fixed: x rows, the send buffers' rows and send_pos must be contiguous")
    ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int32)
    ids = ids if K == 1 or ids.stride(1) == 1 else ids.contiguous()
    w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    w = w if K == 1 or w.stride(1) == 1 else w.contiguous()
    block_h = min(BLOCK_H, next_pow2(H))
    (kernel or _pack_fixed_kernel)[(T, triton.cdiv(H, block_h))](
        x, x.stride(0), send_pos, offsets if offsets is not None else send_pos, ids, ids.stride(0), w, w.stride(0),
        send_x, send_x.stride(0), send_meta, send_meta.stride(0), H, int(experts_per_rank),
        R=R, R_PAD=max(2, next_pow2(R)), K=K, K_PAD=max(2, next_pow2(K)), CAPACITY=int(capacity),
        BLOCK_H=block_h, num_warps=NUM_WARPS)


# ---------------------------------------------------------------------------------------------------------------
# Combine: sum each row's partial outputs from the returned blocks, in destination order
# ---------------------------------------------------------------------------------------------------------------

def combine_fixed_torch(back: torch.Tensor, send_pos: torch.Tensor, out: torch.Tensor, capacity: int, *,
                        offsets: torch.Tensor | None = None) -> None:
    """Reference. out[t] = sum over d = 0..R-1 with a slot s (see `_slots`) of back[s], accumulated in fp32 in
    that order, rounded once; rows with no such d are 0. Other rows of `back` (garbage) are never read."""
    T, R = send_pos.shape
    ok, slot_of = _slots(send_pos, capacity, offsets)
    acc = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
    for d in range(R):
        rows = ok[:, d].nonzero(as_tuple=True)[0]
        acc[rows] += back[slot_of[rows, d]].to(torch.float32)
    out.copy_(acc)


@triton.jit
def _combine_fixed_kernel(back_ptr, stride_back, send_pos_ptr, offsets_ptr, out_ptr, stride_out, H,
                          R: tl.constexpr, CAPACITY: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for d in tl.static_range(R):  # destination order: the same fp32 sum as the reference, bit for bit
        pos = tl.load(send_pos_ptr + t * R + d) + tl.zeros([BLOCK_H], dtype=tl.int32)  # splat: vector masks
        if CAPACITY > 0:
            ok = (pos >= 0) & (pos < CAPACITY)
            slot = (d * CAPACITY + pos).to(tl.int64)
        else:
            ok = pos >= 0
            slot = (tl.load(offsets_ptr + d) + pos).to(tl.int64)
        v = tl.load(back_ptr + slot * stride_back + cols, mask=cmask & ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine_fixed(back: torch.Tensor, send_pos: torch.Tensor, out: torch.Tensor, capacity: int, *,
                  offsets: torch.Tensor | None = None, kernel=None) -> None:
    """Triton: same contract as combine_fixed_torch (CAPACITY constexpr; 0 = exact blocks at `offsets`);
    `kernel` as in pack_fixed."""
    T, R = send_pos.shape
    H = back.shape[1]
    if T == 0:
        return
    if capacity == 0 and offsets is None:
        raise ValueError("combine_fixed: capacity 0 (exact blocks) needs the block offsets")
    check_triton_device(back, out, send_pos)
    if back.stride(1) != 1 or out.stride(1) != 1 or not send_pos.is_contiguous():
        raise ValueError("combine_fixed: back and out rows and send_pos must be contiguous")
    block_h = min(BLOCK_H, next_pow2(H))
    (kernel or _combine_fixed_kernel)[(T, triton.cdiv(H, block_h))](
        back, back.stride(0), send_pos, offsets if offsets is not None else send_pos, out, out.stride(0), H,
        R=R, CAPACITY=int(capacity), BLOCK_H=block_h, num_warps=NUM_WARPS)


# ---------------------------------------------------------------------------------------------------------------
# The path
# ---------------------------------------------------------------------------------------------------------------

def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


def run_plan(use_triton: bool, topk_ids: torch.Tensor, is_padding: torch.Tensor | None, layout: EPLayout,
             capacity: int, send_pos: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
             overflow: torch.Tensor | None = None, block_counts: torch.Tensor | None = None) -> None:
    """The send plan into the path's buffers: the Triton kernels (`block_counts`: their scratch, see plan_sends),
    or the torch reference (copied in)."""
    args = (topk_ids, is_padding, layout.experts_per_rank, layout.world_size, layout.num_experts)
    if use_triton:
        plan_sends(*args, capacity=capacity, send_pos=send_pos, counts=counts, offsets=offsets, overflow=overflow,
                   block_counts=block_counts)
        return
    sp, c, o, over = plan_sends_torch(*args, capacity=capacity)
    send_pos.copy_(sp)
    counts.copy_(c)
    offsets.copy_(o)
    if overflow is not None:
        torch.maximum(overflow, over.to(torch.int32).reshape(1), out=overflow)


def neutralise_blocks(recv_ids: torch.Tensor, recv_counts: torch.Tensor, capacity: int, experts_per_rank: int,
                      use_triton: bool) -> torch.Tensor:
    """In place on [R*capacity, K] local ids: per source block, rows >= its count and ids outside
    [0, experts_per_rank) become -1 (globalize_recv_topk_idx with offset 0, bound E/R: local ids validated)."""
    from moebench.kernels.globalize_recv_topk_idx import globalize_recv_topk_idx, globalize_recv_topk_idx_torch

    fn = globalize_recv_topk_idx if use_triton else globalize_recv_topk_idx_torch
    R = recv_counts.shape[0]
    for s in range(R):
        fn(recv_ids[s * capacity:(s + 1) * capacity], recv_counts[s:s + 1], 0, experts_per_rank)
    return recv_ids


@dataclass
class FixedHandle:
    send_pos: torch.Tensor  # int32 [T, R] (the path's buffer: valid until its next dispatch)
    num_tokens: int


class A2AFixedPath(DispatchPath):
    name = "a2a_fixed"
    receives = "token"
    graph_capturable = True

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, num_tokens: int, capacity: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 use_triton: bool | None = None):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.num_tokens = int(num_tokens)
        self.use_triton = _use_triton(self.device) if use_triton is None else use_triton
        R, K, dev = layout.world_size, top_k, self.device
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

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        R, cap = lay.world_size, self.capacity
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"a2a_fixed was built for {self.num_tokens} rows, got {x.shape[0]}")
        check_mask(is_padding, x.shape[0])
        run_plan(self.use_triton, topk_ids, is_padding, lay, cap, self.send_pos, self.send_counts, self.offsets,
                 self.overflow, self.plan_scratch)
        self._mark("plan")
        self.side.fork_here()
        pack = pack_fixed if self.use_triton else pack_fixed_torch
        pack(x, self.send_pos, topk_ids, topk_weights, self.send_x, self.send_meta, cap, lay.experts_per_rank)
        self._mark("pack")
        with self.side.run():  # the count exchange overlaps the pack (it needs the plan only)
            all_to_all_single(self.recv_counts, self.send_counts, group=lay.group, world_size=R)
            self._mark("count_exchange")
        self.side.join()
        all_to_all_single(self.recv_buf, self.send_buf, group=lay.group, world_size=R)
        self._mark("payload_a2a")
        self.recv_ids.copy_(self.rows.ids(self.recv_buf))
        neutralise_blocks(self.recv_ids, self.recv_counts, cap, lay.experts_per_rank, self.use_triton)
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
        all_to_all_single(back, expert_out.contiguous(), group=lay.group, world_size=lay.world_size)
        self._mark("payload_a2a")
        (combine_fixed if self.use_triton else combine_fixed_torch)(back, handle.send_pos, out, self.capacity)
        self._mark("reduce")
        return out

    # -- checks and accounting (host syncs) ----------------------------------------------------------------------
    def fill_garbage(self, generator: torch.Generator) -> None:
        """Make every buffer look like stale memory: NaN rows and routing that looks valid (local ids in
        [-1, E/R), plausible weights and source rows), so that only the counts can tell real rows from garbage."""
        E_loc, K, T = self.layout.experts_per_rank, self.top_k, max(self.num_tokens, 1)
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
        R, cap = self.layout.world_size, self.capacity
        within = torch.arange(cap, device=self.device).unsqueeze(0) < self.recv_counts.to(torch.int64).unsqueeze(1)
        return within.reshape(R * cap)

    def received(self, d: Dispatched) -> ReceivedRows:
        rows = self.valid_rows().nonzero(as_tuple=True)[0]
        return ReceivedRows(row_index=rows, src_rank=rows // self.capacity,
                            src_row=self.recv_meta[rows, 2 * self.top_k].to(torch.int64))

    def wire_recv_rows(self, d: Dispatched) -> int:
        return self.layout.world_size * self.capacity

    def wire_row_bytes(self) -> int:
        return self.rows.row_bytes
