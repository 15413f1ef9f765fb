"""`a2a_fixed`: fixed-capacity all-to-all, no host synchronisation, CUDA-graph capturable.

Every rank sends a block of `capacity` rows to every rank (block d of the send buffer goes to rank d). The first
`count` rows of a block are real; the rest are whatever the buffer held (uninitialised: torch.empty) and travel
too. The per-destination counts are exchanged on the device alongside the rows; the receiver neutralises the rows
past each source's count with `globalize_recv_topk_idx` (ids are sent as destination-local values and validated
on receipt, offset 0 and bound E/R), so garbage, including valid-looking ids, can never be routed.

`capacity` is a compile-time constant (tl.constexpr) of the pack and combine kernels: each distinct capacity is
one Triton compilation, which is the recompile cost the capacity policies (exact / pow2 / max) trade against
wasted bandwidth. A (source, destination) pair with more rows than the capacity raises an on-device overflow flag
(never silently accepted): `overflowed()` reads it, outside timed regions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.dispatch.base import (DispatchPath, Dispatched, EPLayout, ReceivedRows, all_to_all_single,
                                    effective_ids, meta_weights, token_in_rank)
from moebench.kernels._triton import check_triton_device, interpreting, next_pow2

BLOCK_H = 1024  # hidden columns per program: 2 KB of bf16, a row of 7168 is 7 programs
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------------------------
# Send positions (torch, sync-free)
# ---------------------------------------------------------------------------------------------------------------

def send_positions(in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(send_pos int32 [T, R], counts int32 [R]): row t's slot in destination d's block (-1: not sent), in
    ascending row order; counts before any capacity cut."""
    flags = in_rank.to(torch.int32)
    pos = torch.cumsum(flags, dim=0, dtype=torch.int32) - 1
    send_pos = torch.where(in_rank, pos, torch.full_like(pos, -1)).contiguous()
    return send_pos, flags.sum(0, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Pack: rows (and their routing) into the fixed-capacity send blocks
# ---------------------------------------------------------------------------------------------------------------

def pack_fixed_torch(x: torch.Tensor, send_pos: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, experts_per_rank: int) -> None:
    """Reference. For each (row t, destination d) with 0 <= send_pos[t,d] < capacity, slot s = d*capacity + pos:
    send_x[s] = x[t]; send_meta[s] = [ids local to d (-1 where not d's), weights' fp32 bits, t].
    Slots nobody writes keep their previous content (uninitialised memory)."""
    T, R = send_pos.shape
    K = topk_ids.shape[1]
    ok = (send_pos >= 0) & (send_pos < capacity)
    t_idx, d_idx = ok.nonzero(as_tuple=True)
    slot = d_idx.to(torch.int64) * capacity + send_pos[t_idx, d_idx].to(torch.int64)
    send_x[slot] = x[t_idx]
    g = topk_ids[t_idx].to(torch.int64)
    loc = g - (d_idx.to(torch.int64) * experts_per_rank).unsqueeze(1)
    loc = torch.where((g >= 0) & (loc >= 0) & (loc < experts_per_rank), loc, torch.full_like(loc, -1))
    send_meta[slot, :K] = loc.to(torch.int32)
    send_meta[slot, K:2 * K] = topk_weights[t_idx].to(torch.float32).contiguous().view(torch.int32)
    send_meta[slot, 2 * K] = t_idx.to(torch.int32)


@triton.jit
def _pack_fixed_kernel(x_ptr, stride_x, send_pos_ptr, ids_ptr, w_ptr, send_x_ptr, send_meta_ptr, H,
                       experts_per_rank, R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                       CAPACITY: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    row = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=cmask)  # read once, written to each destination
    ks = tl.arange(0, K_PAD)
    kmask = ks < K
    for d in tl.static_range(R):
        # the slot, splat to vectors: masks must be vectors (Triton's interpreter rejects scalar masks)
        pos_s = tl.load(send_pos_ptr + t * R + d)
        pos = pos_s + tl.zeros([BLOCK_H], dtype=tl.int32)
        ok = (pos >= 0) & (pos < CAPACITY)  # past CAPACITY: dropped here, flagged by the launcher
        slot = (d * CAPACITY + pos).to(tl.int64)
        tl.store(send_x_ptr + slot * H + cols, row, mask=cmask & ok)
        if hb == 0:  # the routing once per (row, destination)
            pos_k = pos_s + tl.zeros([K_PAD], dtype=tl.int32)
            ok_k = (pos_k >= 0) & (pos_k < CAPACITY)
            g = tl.load(ids_ptr + t * K + ks, mask=kmask, other=-1)
            loc = g - d * experts_per_rank
            loc = tl.where((g >= 0) & (loc >= 0) & (loc < experts_per_rank), loc, -1)
            w = tl.load(w_ptr + t * K + ks, mask=kmask, other=0.0)
            meta = send_meta_ptr + (d * CAPACITY + pos_k).to(tl.int64) * (2 * K + 1)
            tl.store(meta + ks, loc.to(tl.int32), mask=kmask & ok_k)
            tl.store(meta + K + ks, w.to(tl.int32, bitcast=True), mask=kmask & ok_k)
            tl.store(meta + 2 * K, tl.zeros([K_PAD], dtype=tl.int32) + t, mask=(ks == 0) & ok_k)  # source row


def pack_fixed(x: torch.Tensor, send_pos: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, experts_per_rank: int, *,
               kernel=None) -> None:
    """Triton: same contract as pack_fixed_torch. CAPACITY is a constexpr: one compile per distinct capacity.
    `kernel`: a fresh JIT copy of _pack_fixed_kernel (jit_trace counts compiles from an empty in-memory cache)."""
    T, R = send_pos.shape
    K = topk_ids.shape[1]
    H = x.shape[1]
    if T == 0:
        return
    check_triton_device(x, send_x)
    if x.stride(1) != 1 or not (send_x.is_contiguous() and send_meta.is_contiguous() and send_pos.is_contiguous()):
        raise ValueError("pack_fixed: x rows and the send buffers must be contiguous")
    ids = topk_ids.to(torch.int32).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    block_h = min(BLOCK_H, next_pow2(H))
    (kernel or _pack_fixed_kernel)[(T, triton.cdiv(H, block_h))](
        x, x.stride(0), send_pos, ids, w, send_x, send_meta, H, experts_per_rank,
        R=R, K=K, K_PAD=next_pow2(K), CAPACITY=int(capacity), BLOCK_H=block_h, num_warps=NUM_WARPS)


# ---------------------------------------------------------------------------------------------------------------
# Combine: sum each row's partial outputs from the returned blocks, in destination order
# ---------------------------------------------------------------------------------------------------------------

def combine_fixed_torch(back: torch.Tensor, send_pos: torch.Tensor, out: torch.Tensor, capacity: int) -> None:
    """Reference. out[t] = sum over d = 0..R-1 with 0 <= send_pos[t,d] < capacity of back[d*capacity + pos],
    accumulated in fp32 in that order, rounded once; rows with no such d are 0. Other rows of `back` (past the
    counts: garbage) are never read."""
    T, R = send_pos.shape
    acc = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
    for d in range(R):
        pos = send_pos[:, d].to(torch.int64)
        ok = (pos >= 0) & (pos < capacity)
        rows = ok.nonzero(as_tuple=True)[0]
        acc[rows] += back[d * capacity + pos[rows]].to(torch.float32)
    out.copy_(acc)


@triton.jit
def _combine_fixed_kernel(back_ptr, send_pos_ptr, out_ptr, stride_out, H, R: tl.constexpr,
                          CAPACITY: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for d in tl.static_range(R):
        pos = tl.load(send_pos_ptr + t * R + d) + tl.zeros([BLOCK_H], dtype=tl.int32)  # splat: vector masks
        ok = (pos >= 0) & (pos < CAPACITY)
        slot = (d * CAPACITY + pos).to(tl.int64)
        v = tl.load(back_ptr + slot * H + cols, mask=cmask & ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine_fixed(back: torch.Tensor, send_pos: torch.Tensor, out: torch.Tensor, capacity: int, *,
                  kernel=None) -> None:
    """Triton: same contract as combine_fixed_torch (CAPACITY constexpr); `kernel` as in pack_fixed."""
    T, R = send_pos.shape
    H = back.shape[1]
    if T == 0:
        return
    check_triton_device(back, out)
    if not back.is_contiguous() or out.stride(1) != 1:
        raise ValueError("combine_fixed: back must be contiguous and out rows contiguous")
    block_h = min(BLOCK_H, next_pow2(H))
    (kernel or _combine_fixed_kernel)[(T, triton.cdiv(H, block_h))](
        back, send_pos, out, out.stride(0), H, R=R, CAPACITY=int(capacity), BLOCK_H=block_h,
        num_warps=NUM_WARPS)


# ---------------------------------------------------------------------------------------------------------------
# The path
# ---------------------------------------------------------------------------------------------------------------

def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


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
    send_pos: torch.Tensor  # int32 [T, R]
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
        # Allocated once; never cleared: rows past the counts keep whatever memory held (that is the point).
        self.send_x = torch.empty(rows, hidden, dtype=dtype, device=dev)
        self.send_meta = torch.empty(rows, 2 * K + 1, dtype=torch.int32, device=dev)
        self.recv_x = torch.empty(rows, hidden, dtype=dtype, device=dev)
        self.recv_meta = torch.empty(rows, 2 * K + 1, dtype=torch.int32, device=dev)
        self.recv_ids = torch.empty(rows, K, dtype=torch.int32, device=dev)
        self.send_counts = torch.zeros(R, dtype=torch.int32, device=dev)
        self.recv_counts = torch.zeros(R, dtype=torch.int32, device=dev)
        self.back = torch.empty(rows, hidden, dtype=dtype, device=dev)
        self.overflow = torch.zeros(1, dtype=torch.int32, device=dev)  # sticky until reset_overflow()

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        R, K, cap = lay.world_size, self.top_k, self.capacity
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"a2a_fixed was built for {self.num_tokens} rows, got {x.shape[0]}")
        ids = effective_ids(topk_ids, is_padding)
        send_pos, counts = send_positions(token_in_rank(ids, lay))
        torch.maximum(self.overflow, (counts.max() > cap).to(torch.int32).reshape(1), out=self.overflow)
        torch.clamp(counts, max=cap, out=self.send_counts)
        pack = pack_fixed if self.use_triton else pack_fixed_torch
        pack(x, send_pos, ids, topk_weights, self.send_x, self.send_meta, cap, lay.experts_per_rank)
        all_to_all_single(self.recv_counts, self.send_counts, group=lay.group, world_size=R)
        all_to_all_single(self.recv_x, self.send_x, group=lay.group, world_size=R)
        all_to_all_single(self.recv_meta, self.send_meta, group=lay.group, world_size=R)
        self.recv_ids.copy_(self.recv_meta[:, :K])
        neutralise_blocks(self.recv_ids, self.recv_counts, cap, lay.experts_per_rank, self.use_triton)
        return Dispatched(recv_x=self.recv_x, recv_topk_ids=self.recv_ids,
                          recv_topk_weights=meta_weights(self.recv_meta, K), num_recv=self.recv_counts,
                          handle=FixedHandle(send_pos, x.shape[0]), send_counts=self.send_counts,
                          recv_counts=self.recv_counts)

    def combine(self, expert_out, handle: FixedHandle, out=None):
        lay = self.layout
        if out is None:
            out = torch.empty(handle.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                              device=expert_out.device)
        all_to_all_single(self.back, expert_out.contiguous(), group=lay.group, world_size=lay.world_size)
        (combine_fixed if self.use_triton else combine_fixed_torch)(self.back, handle.send_pos, out, self.capacity)
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
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + (2 * self.top_k + 1) * 4
