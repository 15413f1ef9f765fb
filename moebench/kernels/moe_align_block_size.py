"""moe_align_block_size: group routes by expert into block_size-aligned segments (docs/contracts.md, "Alignment").

Flat route index i = token * K + k. Routes whose id is < 0 or out of range (or non-local under an expert map)
are skipped, never indexed with. Each expert's routes occupy a segment rounded up to a multiple of block_size,
in ascending i (stable); pad slots hold M*K; expert_ids names the owner of each block, -1 past the padded total.

With `expert_map` (int [E_global], global -> local id or -1), a route id is first range-checked against the
map's length, then replaced by its local id; `num_experts` is then the number of LOCAL experts, and local ids
outside [0, num_experts) are skipped as well.

The Triton path is three launches, all graph-capturable (no host synchronisation), each parallel over the
actual sizes (no single-program pass, no loop over a fixed maximum):
  1. count:   per block of BLOCK_ROUTES routes, a histogram over experts -> counts[block, expert]; the same
              programs fill all of sorted_token_ids with the pad value (route slots are overwritten in step 3)
  2. scan:    one program per chunk of experts: the exclusive prefix of each expert's counts over the blocks
              (in place over counts) and the expert's total; under a grouped_scan config a 2-D grid (chunks x
              groups of blocks) writes the prefixes to a second matrix and the scatter reuses the raw counts
  3. scatter: per block, the segment layout from the E totals (cumsum of the padded counts), num_tokens_post_padded,
              the block's destination base per expert, then sort the keys (expert, position) inside the block:
              the sorted position minus the number of earlier-expert routes in the block is the stable rank
              within the expert, so dest = base[expert] + sorted position. Extra programs (and the same ones)
              write expert_ids, a slice of blocks each.
Every element of the three outputs is written (pad slots by step 1, routes, expert_ids and the total by step 3),
so nothing needs a zero-fill launch.

Where the time goes (instructions issued per route: two histograms over next_pow2(E + 1) bins, the bitonic sort inside a
block, a serial scan on few SMs) and what each candidate of _details/align_config.py changes: "grouped_scan" (a
2-D scan grid, raw counts kept so the scatter needs one histogram, not two), "tight" (next_pow2(E) bins: half the
histogram work at E=256), "tight_br512/256/128" (smaller blocks: shorter sorts, more counts rows to scan),
"tight_br256_w2" (2 warps per 256 routes, for latency). Figures: docs/benchmarks.md#alignment-moe_align_block_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.align_config import (
    ALIGN_CANDIDATES,
    DEFAULT_ALIGN_CONFIG,
    AlignConfig,
    align_capacity,
    align_choice,
    align_launch_shapes,
    align_workspace_size,
    default_block_routes,
    resolve_align_config,
)
from moebench.kernels._details.jit import check_triton_device

__all__ = ["align_capacity", "capacity_fits_int32", "local_expert_ids_torch", "moe_align_block_size_torch",
           "default_block_routes", "align_workspace", "alloc_align_outputs", "align_launch_shapes",
           "moe_align_block_size", "AlignConfig", "ALIGN_CANDIDATES", "DEFAULT_ALIGN_CONFIG",
           "align_choice", "resolve_align_config", "align_workspace_size"]

INT32_MAX = 2**31 - 1
PAD_FILL_STEP = 1024  # largest step of the pad fill (offsets may run this far past the capacity)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------

def capacity_fits_int32(capacity: int) -> bool:
    """Whether the kernels' int32 offsets reach every slot of sorted_token_ids (the pad fill may run PAD_FILL_STEP
    past the end twice)."""
    return capacity + 2 * PAD_FILL_STEP <= INT32_MAX


def local_expert_ids_torch(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None,
                     wrap_negative: bool) -> torch.Tensor:
    """int64 [M*K]: the local expert of every route, or -1 when the route is skipped."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    index_range = expert_map.numel() if expert_map is not None else num_experts
    if wrap_negative:
        # Pre-fix behaviour: torch-style indexing turns -1 into the last entry.
        ids = torch.where((ids < 0) & (ids >= -index_range), ids + index_range, ids)
    if expert_map is not None:
        in_map = (ids >= 0) & (ids < index_range)
        mapped = expert_map.to(torch.int64)[ids.clamp(0, max(index_range - 1, 0))] if index_range else ids
        ids = torch.where(in_map, mapped, torch.full_like(ids, -1))
    return torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, -1))


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                               expert_map: torch.Tensor | None = None, *, wrap_negative: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference (stable argsort + counting); no host synchronisation, so it can be graph-captured.

    `wrap_negative=True` reproduces the pre-fix bug (-1 indexes the last expert / last map entry).
    """
    device = topk_ids.device
    num_routes = topk_ids.numel()
    capacity, num_m_blocks = align_capacity(num_routes, num_experts, block_size)
    local = local_expert_ids_torch(topk_ids, num_experts, expert_map, wrap_negative)
    valid = local >= 0
    key = torch.where(valid, local, torch.full_like(local, num_experts))  # skipped routes sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    num_post_padded = padded.sum()

    order = torch.argsort(key, stable=True)  # within an expert: ascending flat index
    key_sorted = key[order]
    first_sorted = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    valid_sorted = key_sorted < num_experts
    e_sorted = key_sorted.clamp(max=num_experts - 1)
    rank = torch.arange(num_routes, device=device) - first_sorted[e_sorted]
    dest = torch.where(valid_sorted, seg_start[e_sorted] + rank, torch.full_like(rank, capacity))
    sorted_ext = torch.full((capacity + 1,), num_routes, dtype=torch.int32, device=device)
    sorted_ext.scatter_(0, dest, order.to(torch.int32))  # skipped routes land in the dump slot `capacity`
    sorted_token_ids = sorted_ext[:capacity].clone()

    blocks = torch.arange(num_m_blocks, device=device)
    owner = torch.searchsorted(seg_end // block_size, blocks, right=True)
    expert_ids = torch.where(blocks < num_post_padded // block_size, owner, torch.full_like(owner, -1))
    return sorted_token_ids, expert_ids.to(torch.int32), num_post_padded.reshape(1).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _local_expert_ids(topk_ids_ptr, expert_map_ptr, offs, in_range, num_experts, index_range,
                      HAS_MAP: tl.constexpr, WRAP_NEGATIVE: tl.constexpr):
    """Local expert of each route as int32, with skipped routes (and lanes past the end) set to num_experts."""
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    if WRAP_NEGATIVE:
        ids = tl.where((ids < 0) & (ids >= -index_range), ids + index_range, ids)
    if HAS_MAP:
        in_map = in_range & (ids >= 0) & (ids < index_range)
        # Range-check in the id's own dtype first: never index the map with a skipped id.
        ids = tl.load(expert_map_ptr + tl.where(in_map, ids, 0), mask=in_map, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    return tl.where(valid, ids, num_experts).to(tl.int32)


@triton.jit
def _block_histogram(local, num_experts, NUM_BINS: tl.constexpr, TIGHT_BINS: tl.constexpr):
    """Routes per expert of one block (bins >= num_experts hold junk, never stored). TIGHT_BINS: NUM_BINS may
    equal num_experts, so skipped routes are counted in bin 0 and subtracted from it."""
    if TIGHT_BINS:
        skipped = local >= num_experts
        hist = tl.histogram(tl.where(skipped, 0, local), NUM_BINS)
        hist -= tl.where(tl.arange(0, NUM_BINS) == 0, tl.sum(skipped.to(tl.int32), axis=0), 0)
    else:
        # NUM_BINS > num_experts: skipped routes fall into bin num_experts, which is not stored.
        hist = tl.histogram(local, NUM_BINS)
    return hist


@triton.jit
def _align_count_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_ids_ptr,
                        num_routes, num_blocks, num_experts, index_range, capacity, fill_per_program, pad_value,
                        HAS_MAP: tl.constexpr, WRAP_NEGATIVE: tl.constexpr, BLOCK_ROUTES: tl.constexpr,
                        NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr, TIGHT_BINS: tl.constexpr):
    pid = tl.program_id(0)
    if pid < num_blocks:
        offs = pid * BLOCK_ROUTES + tl.arange(0, BLOCK_ROUTES)
        local = _local_expert_ids(topk_ids_ptr, expert_map_ptr, offs, offs < num_routes, num_experts, index_range,
                                  HAS_MAP, WRAP_NEGATIVE)
        hist = _block_histogram(local, num_experts, NUM_BINS, TIGHT_BINS)
        bins = tl.arange(0, NUM_BINS)
        tl.store(counts_ptr + pid * num_experts + bins, hist, mask=bins < num_experts)

    # The pad value everywhere (pad slots inside segments and the tail past the padded total): a plain streaming
    # store, cheaper than working out the pad slots per expert; the scatter overwrites the route slots.
    lo = pid * fill_per_program
    hi = tl.minimum(lo + fill_per_program, capacity)
    fill = tl.zeros([FILL_BLOCK], dtype=tl.int32) + pad_value
    for start in range(lo, hi, FILL_BLOCK):
        idx = start + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_ids_ptr + idx, fill, mask=idx < hi)


@triton.jit
def _align_scan_kernel(counts_ptr, totals_ptr, num_blocks, num_experts,
                       EXPERTS_CHUNK: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Program p owns experts [p*EXPERTS_CHUNK, (p+1)*EXPERTS_CHUNK): counts[b, e] becomes the number of routes of
    e in blocks < b, and totals[e] the number in all blocks. The loop runs over the blocks that exist."""
    experts = tl.program_id(0) * EXPERTS_CHUNK + tl.arange(0, EXPERTS_CHUNK)
    expert_ok = experts < num_experts
    rows = tl.arange(0, TILE_BLOCKS)
    carry = tl.zeros([EXPERTS_CHUNK], dtype=tl.int32)
    for b0 in range(0, num_blocks, TILE_BLOCKS):
        r = b0 + rows
        m = (r < num_blocks)[:, None] & expert_ok[None, :]
        ptrs = counts_ptr + r[:, None] * num_experts + experts[None, :]
        c = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(c, axis=0) - c, mask=m)  # in place: the tile was read above
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + experts, carry, mask=expert_ok)


@triton.jit
def _align_scan_grouped_kernel(counts_ptr, prefix_ptr, totals_ptr, num_blocks, num_experts, group_rows,
                               EXPERTS_CHUNK: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Program (p, g) owns experts [p*EXPERTS_CHUNK, ...) of block rows [g*group_rows, (g+1)*group_rows): it sums
    the counts of the rows before its group (read only: counts stay raw), then writes the exclusive prefix of its
    rows to prefix; the last group writes the totals. Both loops run over the blocks that exist."""
    experts = tl.program_id(0) * EXPERTS_CHUNK + tl.arange(0, EXPERTS_CHUNK)
    expert_ok = experts < num_experts
    rows = tl.arange(0, TILE_BLOCKS)
    lo = tl.program_id(1) * group_rows
    hi = tl.minimum(lo + group_rows, num_blocks)
    carry = tl.zeros([EXPERTS_CHUNK], dtype=tl.int32)
    for b0 in range(0, lo, TILE_BLOCKS):
        r = b0 + rows
        m = (r < lo)[:, None] & expert_ok[None, :]
        carry += tl.sum(tl.load(counts_ptr + r[:, None] * num_experts + experts[None, :], mask=m, other=0), axis=0)
    for b0 in range(lo, hi, TILE_BLOCKS):
        r = b0 + rows
        m = (r < hi)[:, None] & expert_ok[None, :]
        offs = r[:, None] * num_experts + experts[None, :]
        c = tl.load(counts_ptr + offs, mask=m, other=0)
        tl.store(prefix_ptr + offs, carry[None, :] + tl.cumsum(c, axis=0) - c, mask=m)
        carry += tl.sum(c, axis=0)
    if hi == num_blocks:
        tl.store(totals_ptr + experts, carry, mask=expert_ok)


@triton.jit
def _align_scatter_kernel(topk_ids_ptr, expert_map_ptr, base_ptr, counts_ptr, totals_ptr, num_post_padded_ptr,
                          sorted_ids_ptr, expert_ids_ptr,
                          num_routes, num_blocks, num_experts, index_range, block_size, num_m_blocks,
                          m_blocks_per_program,
                          HAS_MAP: tl.constexpr, WRAP_NEGATIVE: tl.constexpr, BLOCK_ROUTES: tl.constexpr,
                          NUM_BINS: tl.constexpr, TILE_M_BLOCKS: tl.constexpr, TIGHT_BINS: tl.constexpr,
                          REUSE_COUNTS: tl.constexpr):
    pid = tl.program_id(0)
    # Segment layout from the per-expert totals: E values, recomputed by every program (cheaper than a launch).
    bins = tl.arange(0, NUM_BINS)
    bin_is_expert = bins < num_experts
    totals = tl.load(totals_ptr + bins, mask=bin_is_expert, other=0)
    padded = (totals + block_size - 1) // block_size * block_size
    seg_end = tl.cumsum(padded, axis=0)
    num_post_padded = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_post_padded_ptr, num_post_padded)

    if pid < num_blocks:
        pos = tl.arange(0, BLOCK_ROUTES)
        offs = pid * BLOCK_ROUTES + pos
        local = _local_expert_ids(topk_ids_ptr, expert_map_ptr, offs, offs < num_routes, num_experts, index_range,
                                  HAS_MAP, WRAP_NEGATIVE)
        # base[e] = seg_start[e] + (routes of e in earlier blocks) - (routes of experts < e in this block), so that
        # base + (position of the route in the block's expert-sorted order) is its destination.
        if REUSE_COUNTS:  # the count launch's histogram, kept raw by the grouped scan
            in_block = tl.load(counts_ptr + pid * num_experts + bins, mask=bin_is_expert, other=0)
        else:
            in_block = _block_histogram(local, num_experts, NUM_BINS, TIGHT_BINS)
        row = base_ptr + pid * num_experts + bins
        earlier = tl.load(row, mask=bin_is_expert, other=0)
        base = seg_end - padded + earlier - (tl.cumsum(in_block, axis=0) - in_block)
        # Through memory to index it by each route's expert: only this program touches this row now, and the
        # barrier makes the whole row visible to every thread of the program before the gather.
        tl.store(row, base, mask=bin_is_expert)
        tl.debug_barrier()
        # Unique keys (expert, position): sorting them orders the block by expert and, within an expert, by
        # flat index, which is the stable order. Skipped routes (expert == num_experts) sort last.
        keys = tl.sort(local * BLOCK_ROUTES + pos)
        expert_sorted = keys // BLOCK_ROUTES
        pos_sorted = keys % BLOCK_ROUTES
        valid = expert_sorted < num_experts
        dest = tl.load(base_ptr + pid * num_experts + expert_sorted, mask=valid, other=0) + pos
        tl.store(sorted_ids_ptr + dest, pid * BLOCK_ROUTES + pos_sorted, mask=valid)

    # expert_ids for this program's slice of blocks: the owner of block b is the number of experts whose segment
    # ends at or before b; -1 past the padded total.
    block_end = tl.where(bin_is_expert, seg_end // block_size, 2147483647)
    used_m_blocks = num_post_padded // block_size
    mb_lo = pid * m_blocks_per_program
    mb_hi = tl.minimum(mb_lo + m_blocks_per_program, num_m_blocks)
    for mb0 in range(mb_lo, mb_hi, TILE_M_BLOCKS):
        mb = mb0 + tl.arange(0, TILE_M_BLOCKS)
        owner = tl.sum((block_end[None, :] <= mb[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + mb, tl.where(mb < used_m_blocks, owner, -1), mask=mb < mb_hi)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------

def align_workspace(num_routes: int, num_experts: int, device, *, block_routes: int | None = None,
                    config: str | AlignConfig | None = None) -> torch.Tensor:
    """int32 scratch: counts/bases [num_blocks, E], per-expert totals [E], and under a grouped_scan config the
    prefixes [num_blocks, E]. Needs no initialisation. `config` as moe_align_block_size's (the same one)."""
    size = align_workspace_size(num_routes, num_experts, block_routes=block_routes, config=config, device=device)
    return torch.empty(size, dtype=torch.int32, device=device)


def alloc_align_outputs(num_routes: int, num_experts: int, block_size: int, device
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    capacity, num_m_blocks = align_capacity(num_routes, num_experts, block_size)
    return (torch.empty(capacity, dtype=torch.int32, device=device),
            torch.empty(num_m_blocks, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                         expert_map: torch.Tensor | None = None, *,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         workspace: torch.Tensor | None = None, block_routes: int | None = None,
                         wrap_negative: bool = False, config: str | AlignConfig | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton alignment -> (sorted_token_ids int32, expert_ids int32, num_tokens_post_padded int32[1]).

    `out` / `workspace` (from alloc_align_outputs / align_workspace) avoid allocation in timed loops.
    `block_routes` (power of two >= 32) overrides the routes per program (tests use it to get many blocks).
    `wrap_negative=True` is the pre-fix (oblivious) behaviour: -1 indexes the last expert / map entry.
    `config`: one of ALIGN_CANDIDATES (name or AlignConfig); None (or "auto"): the tuned table, else
    DEFAULT_ALIGN_CONFIG (align_choice). Every config gives the same outputs; size the workspace with
    align_workspace(..., config=) of the same one.
    """
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts < 1 or block_size < 1:
        raise ValueError(f"num_experts and block_size must be >= 1, got {num_experts}, {block_size}")
    if expert_map is not None and expert_map.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_map must be int32 or int64, got {expert_map.dtype}")
    check_triton_device(topk_ids, expert_map)
    if not topk_ids.is_contiguous():
        topk_ids = topk_ids.contiguous()
    num_routes = topk_ids.numel()
    cfg = resolve_align_config(config, num_routes, num_experts, topk_ids.device)
    capacity, num_m_blocks = align_capacity(num_routes, num_experts, block_size)
    if not capacity_fits_int32(capacity):  # kernel offsets are int32
        raise ValueError(f"alignment capacity {capacity} does not fit the int32 index space")
    sorted_ids, expert_ids, num_post_padded = out if out is not None else \
        alloc_align_outputs(num_routes, num_experts, block_size, topk_ids.device)
    if sorted_ids.numel() != capacity or expert_ids.numel() != num_m_blocks or num_post_padded.numel() != 1:
        raise ValueError("out buffers do not match the alignment sizes (use alloc_align_outputs)")

    if num_routes == 0:  # nothing to sort: all pad, no blocks in use
        sorted_ids.fill_(0)
        expert_ids.fill_(-1)
        num_post_padded.zero_()
        return sorted_ids, expert_ids, num_post_padded

    block_routes = block_routes or default_block_routes(num_routes, cfg)
    if block_routes < 32 or block_routes & (block_routes - 1):
        raise ValueError(f"block_routes must be a power of two >= 32, got {block_routes}")
    shapes = align_launch_shapes(num_routes, num_experts, block_size, block_routes, cfg)
    num_blocks = shapes["num_blocks"]
    if num_experts * block_routes + block_routes > INT32_MAX:
        raise ValueError("num_experts * block_routes overflows the int32 sort key")
    matrix = num_blocks * num_experts
    if workspace is None:
        workspace = align_workspace(num_routes, num_experts, topk_ids.device, block_routes=block_routes, config=cfg)
    if workspace.numel() < matrix * (2 if cfg.grouped_scan else 1) + num_experts or workspace.dtype != torch.int32:
        raise ValueError("workspace too small (use align_workspace with the same block_routes and config)")
    counts = workspace[:matrix]
    totals = workspace[matrix:matrix + num_experts]
    # grouped_scan: the prefixes (then the scatter's bases) in their own matrix, the raw counts kept
    bases = workspace[matrix + num_experts:2 * matrix + num_experts] if cfg.grouped_scan else counts

    has_map = expert_map is not None
    map_arg = expert_map if has_map else topk_ids  # never dereferenced without HAS_MAP
    index_range = expert_map.numel() if has_map else num_experts
    route_warps = shapes["route_warps"]

    _align_count_kernel[(shapes["count_grid"],)](
        topk_ids, map_arg, counts, sorted_ids, num_routes, num_blocks, num_experts, index_range, capacity,
        shapes["fill_per_program"], num_routes,
        HAS_MAP=has_map, WRAP_NEGATIVE=wrap_negative, BLOCK_ROUTES=block_routes, NUM_BINS=shapes["num_bins"],
        FILL_BLOCK=shapes["fill_block"], TIGHT_BINS=cfg.tight_bins, num_warps=route_warps)
    if cfg.grouped_scan:
        _align_scan_grouped_kernel[(shapes["scan_grid"], shapes["scan_groups"])](
            counts, bases, totals, num_blocks, num_experts, shapes["scan_group_rows"],
            EXPERTS_CHUNK=shapes["experts_chunk"], TILE_BLOCKS=shapes["tile_blocks"],
            num_warps=shapes["scan_warps"])
    else:
        _align_scan_kernel[(shapes["scan_grid"],)](
            counts, totals, num_blocks, num_experts,
            EXPERTS_CHUNK=shapes["experts_chunk"], TILE_BLOCKS=shapes["tile_blocks"],
            num_warps=shapes["scan_warps"])
    _align_scatter_kernel[(shapes["scatter_grid"],)](
        topk_ids, map_arg, bases, counts, totals, num_post_padded, sorted_ids, expert_ids,
        num_routes, num_blocks, num_experts, index_range, block_size, num_m_blocks, shapes["m_blocks_per_program"],
        HAS_MAP=has_map, WRAP_NEGATIVE=wrap_negative, BLOCK_ROUTES=block_routes, NUM_BINS=shapes["num_bins"],
        TILE_M_BLOCKS=shapes["tile_m_blocks"], TIGHT_BINS=cfg.tight_bins, REUSE_COUNTS=cfg.grouped_scan,
        num_warps=route_warps)
    return sorted_ids, expert_ids, num_post_padded
