"""The fixed-capacity blocks' kernels: pack rows (and their routing) into per-destination send blocks, and combine
each row's returned partial outputs from them; their torch references; the send positions; the capacity policies.

Block d of a send buffer goes to rank d. With CAPACITY > 0 it holds `capacity` rows at [d*capacity,
(d+1)*capacity) (the a2a_fixed path; pairs past the capacity are dropped here and flagged by the send plan); with
CAPACITY = 0 it starts at a device offset, the exclusive prefix of the counts (the exact-size a2a path).
`capacity` is a compile-time constant (tl.constexpr) of both kernels: each distinct capacity is one Triton
compilation, which is the recompile cost the capacity policies (exact / pow2 / max) trade against wasted
bandwidth. `PACK_FIXED_KERNEL` and `COMBINE_FIXED_KERNEL` are the two JIT functions (the jit_trace target counts
their compiles on fresh copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.kernels.runtime import check_triton_device, next_pow2
from moebench.params import Params, register_knobs

BLOCK_H = 1024  # hidden columns per program: 2 KB of bf16 (one 16-byte vector per thread), 7 programs per 7168
NUM_WARPS = 4
CAPACITY_POLICIES = ("exact", "pow2", "max")


@register_knobs
@dataclass(frozen=True)
class CapacityKnobs:
    """The sweep keys of the fixed-capacity buffers (the a2a_fixed path, DeepEP, the jit_trace and serving_trace
    capacities): the capacity policy (capacity_for) and the rows each rank's buffer holds per destination."""

    capacity_policy: str = "exact"
    num_max_tokens_per_rank: int = 8192

    KEYED_AT_DEFAULT = frozenset({"capacity_policy", "num_max_tokens_per_rank"})
    CHOICES = {"capacity_policy": CAPACITY_POLICIES}

    def problem(self, p: Params) -> str | None:
        if self.num_max_tokens_per_rank < 1:
            return f"num_max_tokens_per_rank: must be >= 1, got {self.num_max_tokens_per_rank}"
        return None


def capacity_for(policy: str, max_rows: int, buffer_rows: int) -> int:
    """Rows per (source, destination) block of the fixed-capacity path.

    exact: the step's max rows per (src, dst) pair; pow2: its next power of two, capped at the buffer;
    max: always the buffer size. Never below 1 (an empty step still launches valid kernels).
    """
    if policy not in CAPACITY_POLICIES:
        raise ValueError(f"unknown capacity policy {policy!r} (one of {', '.join(CAPACITY_POLICIES)})")
    if buffer_rows < 1:
        raise ValueError(f"buffer_rows must be >= 1, got {buffer_rows}")
    need = max(1, int(max_rows))
    if need > buffer_rows:
        raise ValueError(f"max rows per rank pair {need} exceed the buffer ({buffer_rows} rows): raise "
                         f"num_max_tokens_per_rank")
    if policy == "exact":
        return need
    if policy == "pow2":
        return min(1 << (need - 1).bit_length(), buffer_rows)
    return buffer_rows


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
                     send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, local_experts: int, *,
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
    loc = g - (d_idx.to(torch.int64) * local_experts).unsqueeze(1)
    loc = torch.where((g >= 0) & (loc >= 0) & (loc < local_experts), loc, torch.full_like(loc, -1))
    send_meta[slot, :K] = loc.to(torch.int32)
    send_meta[slot, K:2 * K] = topk_weights[t_idx].to(torch.float32).contiguous().view(torch.int32)
    send_meta[slot, 2 * K] = t_idx.to(torch.int32)


@triton.jit
def _pack_fixed_kernel(x_ptr, stride_x, send_pos_ptr, offsets_ptr, ids_ptr, stride_ids, w_ptr, stride_w,
                       send_x_ptr, stride_sx, send_meta_ptr, stride_sm, H, local_experts, R: tl.constexpr,
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
        loc = g[None, :] - (ds * local_experts)[:, None]  # [R_PAD, K_PAD]: local to each destination
        loc = tl.where((g[None, :] >= 0) & (loc >= 0) & (loc < local_experts), loc, -1).to(tl.int32)
        meta = send_meta_ptr + slot[:, None] * stride_sm + ks[None, :]
        m2 = ok[:, None] & kmask[None, :]
        tl.store(meta, loc, mask=m2)
        tl.store(meta + K, tl.broadcast_to(w.to(tl.int32, bitcast=True)[None, :], [R_PAD, K_PAD]), mask=m2)
        tl.store(send_meta_ptr + slot * stride_sm + 2 * K, tl.zeros([R_PAD], dtype=tl.int32) + t.to(tl.int32),
                 mask=ok)  # source row


def pack_fixed(x: torch.Tensor, send_pos: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int, local_experts: int, *,
               offsets: torch.Tensor | None = None, kernel=None) -> None:
    """Triton: same contract as pack_fixed_torch. CAPACITY is a constexpr: one compile per distinct capacity
    (0: exact blocks at `offsets`, the a2a path). send_x / send_meta may be strided views (rows contiguous), e.g.
    the two parts of a RowLayout buffer. `kernel`: a fresh JIT copy of PACK_FIXED_KERNEL (jit_trace counts
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
        send_x, send_x.stride(0), send_meta, send_meta.stride(0), H, int(local_experts),
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


# The JIT functions, for callers that launch fresh copies of them (measure.jit.fresh_kernel)
PACK_FIXED_KERNEL = _pack_fixed_kernel
COMBINE_FIXED_KERNEL = _combine_fixed_kernel
