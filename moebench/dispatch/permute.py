"""What the all-to-all paths share on the device: the send plan, the wire row layout, id localisation.

`plan_sends` turns the routing into the send plan in two Triton launches over blocks of rows (per-block row counts
per destination; then each block adds up the earlier blocks' counts and ranks its own rows): for every (row,
destination rank) pair the row's slot in that destination's block, per-destination row counts (optionally capped
at a fixed capacity, with a sticky overflow flag) and their exclusive prefix sums (where each block starts in an
exact-size send buffer). It replaces about fifteen small torch launches (mask, one-hot scatter, cumsum, sums, ...)
and reads `is_padding` itself, so the step needs no host synchronisation before the count exchange. (It runs over
blocks of rows because a single program scanning every row serially has one SM's worth of bandwidth.)

`RowLayout`: one wire row is the hidden row followed by its routing metadata (the K ids, the K fp32 weights' bits
and the source row index), so rows and routing travel in ONE all_to_all instead of two. Both parts start on a
`ROW_ALIGN`-byte boundary, which keeps every view's row stride a multiple of 16 elements: Triton vectorises the
row copies only when it can prove that alignment.

`localize_ids`: global expert ids -> this rank's local ids (-1 elsewhere) in one pass, from a strided view
(the agrs receive side).

`run_plan`: the send plan into a path's buffers, by the Triton kernels or the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.dispatch.base import EPLayout
from moebench.kernels.contract import check_mask
from moebench.kernels.runtime import check_triton_device, next_pow2

ROW_ALIGN = 32  # bytes; see the module docstring
PLAN_TILE_ELEMENTS = 8192  # most (row, slot[, destination]) elements one plan program holds
PLAN_BLOCK_ROWS = 64  # rows per plan program (a constant: see plan_block_rows)
PLAN_NB_CHUNK = 64  # block counts summed per step when a program adds up the earlier blocks
PLAN_NUM_WARPS = 4
LOCALIZE_BLOCK_ROWS = 256
LOCALIZE_NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------------------------
# Wire rows: hidden row + routing metadata
# ---------------------------------------------------------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class RowLayout:
    """A byte buffer [rows, row_bytes]: bytes [0, x_bytes) are the hidden row (dtype), bytes [meta_offset,
    meta_offset + 4 * meta_words) are int32 words: K ids, K weights (fp32 bits), the source row."""

    hidden: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def x_bytes(self) -> int:
        return self.hidden * self.element_size

    @property
    def meta_words(self) -> int:
        return 2 * self.top_k + 1

    @property
    def meta_offset(self) -> int:
        return _round_up(self.x_bytes, ROW_ALIGN)

    @property
    def row_bytes(self) -> int:
        return _round_up(self.meta_offset + 4 * self.meta_words, ROW_ALIGN)

    def empty(self, rows: int, device: torch.device | str) -> torch.Tensor:
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def x(self, buf: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] view of the hidden rows (row stride row_bytes / element size)."""
        return buf[:, :self.x_bytes].view(self.dtype)

    def meta(self, buf: torch.Tensor) -> torch.Tensor:
        """[rows, 2K+1] int32 view of the metadata."""
        return buf[:, self.meta_offset:self.meta_offset + 4 * self.meta_words].view(torch.int32)

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        return self.meta(buf)[:, :self.top_k]

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        return self.meta(buf)[:, self.top_k:2 * self.top_k].view(torch.float32)

    def src_row(self, buf: torch.Tensor) -> torch.Tensor:
        return self.meta(buf)[:, 2 * self.top_k]


# ---------------------------------------------------------------------------------------------------------------
# The send plan
# ---------------------------------------------------------------------------------------------------------------

def plan_sends_torch(topk_ids: torch.Tensor, is_padding: torch.Tensor | None, local_experts: int,
                     world_size: int, num_experts: int, capacity: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference. -> (send_pos int32 [T, R], counts int32 [R], offsets int32 [R], overflow bool [] on the device).

    A slot is live when 0 <= id < num_experts and its row is not padding; row t goes to rank d when a live slot
    has id // local_experts == d. send_pos[t, d] = the number of rows t' < t that go to d (rows keep their
    order within a destination), -1 when t does not go to d. counts[d] = rows going to d, capped at `capacity`
    when capacity > 0; overflow = capacity > 0 and some uncapped count exceeds it. offsets = exclusive prefix
    sums of counts.
    """
    check_mask(is_padding, topk_ids.shape[0])
    T = topk_ids.shape[0]
    ids = topk_ids.to(torch.int64)
    live = (ids >= 0) & (ids < num_experts)
    if is_padding is not None:
        live &= ~is_padding.to(torch.bool).unsqueeze(1)
    dest = torch.where(live, ids.div(local_experts, rounding_mode="floor"), world_size)
    goes = torch.zeros(T, world_size + 1, dtype=torch.bool, device=ids.device)
    goes.scatter_(1, dest, True)  # column R collects the slots that go nowhere
    goes = goes[:, :world_size]
    pos = torch.cumsum(goes.to(torch.int32), dim=0, dtype=torch.int32) - 1
    send_pos = torch.where(goes, pos, torch.full_like(pos, -1)).contiguous()
    raw = goes.sum(0, dtype=torch.int32)
    counts = torch.clamp(raw, max=capacity) if capacity > 0 else raw
    overflow = (raw > capacity).any() if capacity > 0 else torch.zeros((), dtype=torch.bool, device=ids.device)
    offsets = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
    return send_pos, counts.to(torch.int32), offsets, overflow


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _row_destinations(ids_ptr, stride_ids, pad_ptr, t, t_ok, num_experts, LOCAL_EXPERTS: tl.constexpr,
                      R_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, HAS_PAD: tl.constexpr):
    """[BLOCK_T, R_PAD] int32: 1 where row t has at least one live slot on destination d."""
    ks = tl.arange(0, K_PAD)
    ds = tl.arange(0, R_PAD)
    ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * stride_ids + ks[None, :],
                  mask=t_ok[:, None] & (ks[None, :] < K), other=-1)
    live = (ids >= 0) & (ids < num_experts)
    if HAS_PAD:
        pad = tl.load(pad_ptr + t, mask=t_ok, other=1)
        live = live & (pad == 0)[:, None]
    # a compile-time divisor: a shift or a multiply instead of a ~20-instruction integer division per slot
    dest = tl.where(live, ids // LOCAL_EXPERTS, -1).to(tl.int32)  # [BLOCK_T, K_PAD]
    if R_PAD <= 32:
        # a row's destinations as a bit set (OR over its slots, within a thread), then one bit per column
        bits = tl.reduce(tl.where(dest >= 0, 1 << tl.maximum(dest, 0), 0), 1, _bit_or)  # [BLOCK_T]
        goes = (bits[:, None] >> ds[None, :]) & 1  # [BLOCK_T, R_PAD]
    else:
        hit = (dest[:, :, None] == ds[None, None, :]).to(tl.int32)  # [BLOCK_T, K_PAD, R_PAD]
        goes = tl.max(hit, axis=1)  # [BLOCK_T, R_PAD]: at least one live slot for that destination
    return goes


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size
def _plan_block_counts_kernel(ids_ptr, stride_ids, pad_ptr, block_counts_ptr, T, num_experts,
                              LOCAL_EXPERTS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, K: tl.constexpr,
                              K_PAD: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    # pass 1: rows per destination within each block of BLOCK_T rows
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    goes = _row_destinations(ids_ptr, stride_ids, pad_ptr, t, t < T, num_experts, LOCAL_EXPERTS, R_PAD, K, K_PAD,
                             HAS_PAD)
    ds = tl.arange(0, R_PAD)
    tl.store(block_counts_ptr + pid * R + ds, tl.sum(goes, axis=0), mask=ds < R)


@triton.jit(do_not_specialize=["T", "num_blocks", "capacity"])  # one compile for every batch size and capacity
def _plan_positions_kernel(ids_ptr, stride_ids, pad_ptr, block_counts_ptr, send_pos_ptr, counts_ptr, offsets_ptr,
                           overflow_ptr, T, num_blocks, num_experts, capacity, LOCAL_EXPERTS: tl.constexpr,
                           R: tl.constexpr, R_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                           HAS_PAD: tl.constexpr, HAS_OVERFLOW: tl.constexpr, BLOCK_T: tl.constexpr,
                           NB_CHUNK: tl.constexpr):
    # pass 2: each block's start per destination = the sum of the earlier blocks' counts (a few hundred int32 at
    # most, read from L2), then the block's rows are ranked again; program 0 also writes the totals
    pid = tl.program_id(0)
    ds = tl.arange(0, R_PAD)
    d_ok = ds < R
    before = tl.zeros([R_PAD], dtype=tl.int32)
    total = tl.zeros([R_PAD], dtype=tl.int32)
    for j0 in range(0, num_blocks, NB_CHUNK):
        js = j0 + tl.arange(0, NB_CHUNK)
        c = tl.load(block_counts_ptr + js[:, None] * R + ds[None, :], mask=(js < num_blocks)[:, None] & d_ok[None, :],
                    other=0)
        before += tl.sum(tl.where((js < pid)[:, None], c, 0), axis=0)
        total += tl.sum(c, axis=0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    goes = _row_destinations(ids_ptr, stride_ids, pad_ptr, t, t_ok, num_experts, LOCAL_EXPERTS, R_PAD, K, K_PAD,
                             HAS_PAD)
    pos = before[None, :] + tl.cumsum(goes, axis=0) - 1
    tl.store(send_pos_ptr + t[:, None].to(tl.int64) * R + ds[None, :], tl.where(goes > 0, pos, -1),
             mask=t_ok[:, None] & d_ok[None, :])
    if pid == 0:
        capped = tl.where(capacity > 0, tl.minimum(total, capacity), total)
        tl.store(counts_ptr + ds, capped, mask=d_ok)
        tl.store(offsets_ptr + ds, tl.cumsum(capped, axis=0) - capped, mask=d_ok)
        if HAS_OVERFLOW:
            over = tl.max(((capacity > 0) & (total > capacity) & d_ok).to(tl.int32), axis=0)
            tl.store(overflow_ptr, tl.maximum(tl.load(overflow_ptr), over))  # sticky until the owner resets it


def plan_block_rows(K: int, R: int) -> int:
    """Rows per program of plan_sends: PLAN_BLOCK_ROWS, fewer where a [rows, slots(, destinations)] tile would
    pass PLAN_TILE_ELEMENTS, never fewer than 16. Not a function of the batch size on purpose: BLOCK_T is a
    compile-time constant, so a value that followed it would recompile the plan for every new size range (the
    batch size only sets the number of programs: 64 at 4096 rows)."""
    k_pad, r_pad = max(2, next_pow2(K)), max(2, next_pow2(R))
    most = PLAN_TILE_ELEMENTS // (k_pad * (1 if r_pad <= 32 else r_pad))
    return max(16, min(PLAN_BLOCK_ROWS, next_pow2(most + 1) // 2))


def plan_scratch(num_tokens: int, top_k: int, world_size: int, device: torch.device | str) -> torch.Tensor:
    """The block-counts scratch plan_sends needs for any step of up to `num_tokens` rows (default block size)."""
    blocks = max(1, triton.cdiv(num_tokens, plan_block_rows(top_k, world_size)))
    return torch.empty(blocks * world_size, dtype=torch.int32, device=device)


def plan_sends(topk_ids: torch.Tensor, is_padding: torch.Tensor | None, local_experts: int, world_size: int,
               num_experts: int, *, capacity: int = 0, send_pos: torch.Tensor | None = None,
               counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
               overflow: torch.Tensor | None = None, block_counts: torch.Tensor | None = None,
               block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton: plan_sends_torch's contract, written into the given buffers (allocated when None): send_pos int32
    [T, R] contiguous, counts and offsets int32 [R] (contiguous), overflow int32 [1] raised to 1 (never lowered)
    on overflow. Two launches (per-block counts, then positions), no host synchronisation. `block_counts`: int32
    scratch of at least cdiv(T, block_rows) * R elements (allocated when None; a caller that replays the plan in a
    CUDA graph passes its own). `block_rows`: rows per program (default plan_block_rows; a power of two >= 16).
    Returns (send_pos, counts, offsets)."""
    T, K = topk_ids.shape
    R = world_size
    check_mask(is_padding, T)
    dev = topk_ids.device
    if send_pos is None:
        send_pos = torch.empty(T, R, dtype=torch.int32, device=dev)
    if counts is None:
        counts = torch.empty(R, dtype=torch.int32, device=dev)
    if offsets is None:
        offsets = torch.empty(R, dtype=torch.int32, device=dev)
    for name, buf, shape in (("send_pos", send_pos, (T, R)), ("counts", counts, (R,)), ("offsets", offsets, (R,))):
        if tuple(buf.shape) != shape or buf.dtype != torch.int32 or not buf.is_contiguous():
            raise ValueError(f"plan_sends: {name} must be a contiguous int32 tensor of shape {shape}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or (K > 1 and topk_ids.stride(1) != 1):
        raise ValueError("plan_sends: topk_ids must be int32/int64 with contiguous rows")
    block_t = block_rows or plan_block_rows(K, R)
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"plan_sends: block_rows must be a power of two >= 16, got {block_t}")
    num_blocks = max(1, triton.cdiv(T, block_t))  # one program even for T == 0: it writes the zero totals
    if block_counts is None:
        block_counts = torch.empty(num_blocks * R, dtype=torch.int32, device=dev)
    if block_counts.dtype != torch.int32 or not block_counts.is_contiguous() or block_counts.numel() < num_blocks * R:
        raise ValueError(f"plan_sends: block_counts must be contiguous int32 with >= {num_blocks * R} elements")
    check_triton_device(topk_ids, send_pos, counts, offsets, is_padding, overflow, block_counts)
    pad = is_padding.view(torch.uint8) if is_padding is not None and is_padding.dtype == torch.bool else is_padding
    pad_arg = pad if pad is not None else topk_ids
    k_pad, r_pad = max(2, next_pow2(K)), max(2, next_pow2(R))
    common = dict(LOCAL_EXPERTS=int(local_experts), R=R, R_PAD=r_pad, K=K, K_PAD=k_pad,
                  HAS_PAD=pad is not None, BLOCK_T=block_t, num_warps=PLAN_NUM_WARPS)
    _plan_block_counts_kernel[(num_blocks,)](topk_ids, topk_ids.stride(0), pad_arg, block_counts, T,
                                             int(num_experts), **common)
    _plan_positions_kernel[(num_blocks,)](
        topk_ids, topk_ids.stride(0), pad_arg, block_counts, send_pos, counts, offsets,
        overflow if overflow is not None else counts, T, num_blocks, int(num_experts), int(capacity),
        HAS_OVERFLOW=overflow is not None, NB_CHUNK=PLAN_NB_CHUNK, **common)
    return send_pos, counts, offsets


def run_plan(use_triton: bool, topk_ids: torch.Tensor, is_padding: torch.Tensor | None, layout: EPLayout,
             capacity: int, send_pos: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
             overflow: torch.Tensor | None = None, block_counts: torch.Tensor | None = None) -> None:
    """The send plan into the path's buffers: the Triton kernels (`block_counts`: their scratch, see plan_sends),
    or the torch reference (copied in)."""
    args = (topk_ids, is_padding, layout.local_experts, layout.ep_size, layout.num_experts)
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


# ---------------------------------------------------------------------------------------------------------------
# Global -> local expert ids
# ---------------------------------------------------------------------------------------------------------------

def localize_ids_torch(global_ids: torch.Tensor, expert_offset: int, local_experts: int) -> torch.Tensor:
    """Reference: int32 [N, K], global id - expert_offset where that lies in [0, local_experts) (and the id is
    >= 0), else -1."""
    g = global_ids.to(torch.int64)
    loc = g - expert_offset
    keep = (g >= 0) & (loc >= 0) & (loc < local_experts)
    return torch.where(keep, loc, torch.full_like(loc, -1)).to(torch.int32)


@triton.jit
def _localize_ids_kernel(src_ptr, stride_src, out_ptr, n_rows, expert_offset, local_experts, K: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.arange(0, K_PAD)
    m = (rows < n_rows)[:, None] & (ks < K)[None, :]
    g = tl.load(src_ptr + rows[:, None] * stride_src + ks[None, :], mask=m, other=-1)
    loc = g - expert_offset
    keep = (g >= 0) & (loc >= 0) & (loc < local_experts)
    tl.store(out_ptr + rows[:, None] * K + ks[None, :], tl.where(keep, loc, -1).to(tl.int32), mask=m)


def localize_ids(global_ids: torch.Tensor, expert_offset: int, local_experts: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: localize_ids_torch's contract into `out` (int32 [N, K] contiguous; allocated when None).
    `global_ids` may be a strided view (contiguous rows), e.g. the id columns of a metadata buffer."""
    N, K = global_ids.shape
    if out is None:
        out = torch.empty(N, K, dtype=torch.int32, device=global_ids.device)
    if tuple(out.shape) != (N, K) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"localize_ids: out must be a contiguous int32 tensor of shape {(N, K)}")
    if K > 1 and global_ids.stride(1) != 1:
        raise ValueError("localize_ids: global_ids rows must be contiguous")
    if N == 0:
        return out
    check_triton_device(global_ids, out)
    _localize_ids_kernel[(triton.cdiv(N, LOCALIZE_BLOCK_ROWS),)](
        global_ids, global_ids.stride(0), out, N, int(expert_offset), int(local_experts), K=K,
        K_PAD=max(2, next_pow2(K)), BLOCK_R=LOCALIZE_BLOCK_ROWS, num_warps=LOCALIZE_NUM_WARPS)
    return out
