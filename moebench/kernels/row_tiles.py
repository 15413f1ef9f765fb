"""row_tile_map: the row tiles of the paired expert GEMMs, built on the device from the alignment.

With block_m-row alignment blocks (moe_align_block_size), a paired launch (ExpertsConfig.paired) computes each
expert's blocks two at a time: full tiles of 2*block_m rows, and the expert's odd last block, if any, on a tile of
block_m rows. An expert's padding therefore costs what block_m-row tiles cost (at most block_m - 1 rows), while its
full tiles keep the 2*block_m-row tiles' weight reuse (half the weight reads per row). The tiles are listed in
expert order, an expert's last (narrow) tile right after its full ones, so the grouped program order (swizzle)
runs them together and they share the expert's weight tiles in L2.

    tile_map[t] = 2 * first_block(t) + (1 if tile t spans two blocks else 0),  t < num_tiles[0]

first_block counts block_m-row blocks (the tile's first sorted position is first_block * block_m). The GEMMs take
their tiles from a counter (num_tiles[1] for gate/up, [3] for down; zeroed here, and again by each launch's last
program, so a launch can be repeated on the same map), not in a fixed round-robin: a program that finishes a narrow
tile early takes the next tile in order, so the tiles in flight stay a contiguous window of the grouped order (the
weight tiles they share stay in L2) and no program is left with more full tiles than another (under a fixed
round-robin, programs that finish narrow tiles early run ahead of their swizzle group and lose its L2). A block starts
a tile when its offset from its expert's first block is even; blocks past num_post_padded / block_m do not exist
and are never read. One program (the block count is a few thousand at most per 10^5 routes), a chunked scan:
no host synchronisation (CUDA-graph capturable). `row_tile_map_torch` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device

__all__ = ["row_tile_map", "row_tile_map_torch", "row_tile_buffers"]

_CHUNK = 1024  # blocks per step of the scan: 10^5 routes over 256 experts make at most ~1800 blocks of 64


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_tile_map_kernel(expert_ids_ptr, num_post_ptr, tile_map_ptr, num_tiles_ptr,
                         BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    num_blocks = tl.load(num_post_ptr) // BLOCK_M
    zero = tl.program_id(0) * 0  # an int32 scalar tensor: the loop-carried values below are tensors
    seg = zero  # first block of the expert whose blocks the previous chunk ended in
    tiles = zero
    # the GEMMs' tile counters (gate/up: next tile, programs done; down: the same) start at 0
    for c in tl.static_range(1, 5):
        tl.store(num_tiles_ptr + c, zero)
    for start in range(0, num_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        inb = b < num_blocks
        e = tl.load(expert_ids_ptr + b, mask=inb, other=-1)
        e_prev = tl.load(expert_ids_ptr + b - 1, mask=inb & (b > 0), other=-1)
        e_next = tl.load(expert_ids_ptr + b + 1, mask=(b + 1) < num_blocks, other=-2)
        first = inb & (e != e_prev)
        seg_b = tl.maximum(tl.associative_scan(tl.where(first, b, -1), 0, _max_combine), seg)
        starts = inb & ((b - seg_b) % 2 == 0)
        full = starts & (e_next == e)
        s32 = starts.to(tl.int32)
        idx = tiles + tl.cumsum(s32, 0) - s32
        tl.store(tile_map_ptr + idx, b * 2 + full.to(tl.int32), mask=starts)
        tiles += tl.sum(s32, 0)
        seg = tl.max(tl.where(inb, seg_b, 0), 0)
    tl.store(num_tiles_ptr, tiles)


def row_tile_buffers(max_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_map int32 [max_blocks], num_tiles int32 [5]): row_tile_map's outputs, for a workspace (max_blocks: the
    alignment's block capacity, align_capacity(...)[1]). num_tiles[0] is the count; [1:3] and [3:5] the gate/up and
    down GEMMs' tile counters (next tile, programs done), zeroed by row_tile_map and by each launch's last program."""
    return (torch.empty(max(1, max_blocks), dtype=torch.int32, device=device),
            torch.empty(5, dtype=torch.int32, device=device))


def row_tile_map(expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int, *,
                 out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_map, num_tiles) written into `out` (row_tile_buffers with at least the alignment's block capacity):
    see the module docstring. expert_ids / num_post: moe_align_block_size's, at block size block_m."""
    check_triton_device(expert_ids, num_post)
    tile_map, num_tiles = out
    if (tile_map.dtype != torch.int32 or num_tiles.dtype != torch.int32 or tile_map.numel() < expert_ids.numel()
            or num_tiles.numel() < 5):
        raise ValueError(f"row_tile_map: out needs int32 tile_map with >= {expert_ids.numel()} elements and int32 "
                         f"num_tiles [5], got {tile_map.dtype} [{tile_map.numel()}], {num_tiles.dtype} "
                         f"[{num_tiles.numel()}]")
    _row_tile_map_kernel[(1,)](expert_ids, num_post, tile_map, num_tiles, BLOCK_M=block_m, CHUNK=_CHUNK,
                               num_warps=4)
    return tile_map, num_tiles


def row_tile_map_torch(expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int
                       ) -> tuple[torch.Tensor, int]:
    """Reference: (tile_map int32 [num_tiles], num_tiles), walking the existing blocks expert by expert."""
    ids = expert_ids[: int(num_post.item()) // block_m].tolist()
    codes, b = [], 0
    while b < len(ids):
        end = b
        while end < len(ids) and ids[end] == ids[b]:
            end += 1
        for first in range(b, end, 2):
            codes.append(2 * first + (1 if first + 1 < end else 0))
        b = end
    return torch.tensor(codes, dtype=torch.int32), len(codes)
