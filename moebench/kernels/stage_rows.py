"""stage_rows: the gate/up GEMM's A rows copied into sorted order, so both of its operands can be read through TMA
descriptors (GemmConfig.act_tma on the gate/up GEMM), and its plain-torch reference `stage_rows_torch`.

    x_rows[j] = x[sorted_ids[j] // top_k]   for every sorted position j < num_post_padded holding a route
    x_rows[j] = 0                           for the pad entries of an expert's last block (sorted_ids[j] >= R)

Rows at and past num_post_padded are not written. A bit copy of x's elements (bf16 or e4m3), read on the device
like the GEMMs (num_post_padded is not read on the host): persistent programs walk blocks of positions.
Cost: the copy writes num_post * H elements once and reads each token's row once per route (L2 keeps a token's
row for its top_k routes when they are close); in return the gate/up main loop issues one TMA copy per A tile
instead of a cp.async gather over BLOCK_M row pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, interpreting

__all__ = ["stage_rows", "stage_rows_torch"]


@triton.jit
def _stage_rows_kernel(x_ptr, out_ptr, sorted_ptr, num_post_ptr, num_routes, top_k, hidden, stride_x, stride_o,
                       num_programs, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    num_post = tl.load(num_post_ptr)
    for blk in range(tl.program_id(0), tl.cdiv(num_post, BLOCK_P), num_programs):
        offs_p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = offs_p < num_post
        route = tl.load(sorted_ptr + offs_p, mask=p_ok, other=num_routes)
        ok = route < num_routes
        token = (route // top_k).to(tl.int64)
        src = x_ptr + token[:, None] * stride_x
        dst = out_ptr + offs_p.to(tl.int64)[:, None] * stride_o
        for h in range(0, hidden, BLOCK_H):
            offs_h = h + tl.arange(0, BLOCK_H)
            h_ok = offs_h < hidden
            v = tl.load(src + offs_h[None, :], mask=ok[:, None] & h_ok[None, :], other=0)
            tl.store(dst + offs_h[None, :], v, mask=p_ok[:, None] & h_ok[None, :])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as integers of its element size: the copy moves bits, whatever the float format."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def stage_rows(x: torch.Tensor, sorted_ids: torch.Tensor, num_post: torch.Tensor, top_k: int, out: torch.Tensor,
               *, block_p: int = 4, block_h: int | None = None) -> torch.Tensor:
    """out[j] for every sorted position j < num_post (see the module docstring); out: [>= positions, H] of x's
    dtype, contiguous rows. No host synchronisation."""
    check_triton_device(x, sorted_ids, num_post, out)
    M, H = x.shape
    if out.dtype != x.dtype or out.shape[1] != H or out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"out: expected {x.dtype} [rows, {H}] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    positions = min(sorted_ids.numel(), out.shape[0])
    if M == 0 or positions == 0:
        return out
    if block_h is None:  # 2 KB of each of block_p rows a step: four 16-byte vectors a thread over 4 warps
        block_h = min(triton.next_power_of_2(H), 64 if interpreting() else 2048 // x.element_size())
    blocks = triton.cdiv(positions, block_p)
    if x.device.type == "cuda":  # enough programs to keep the copy's loads in flight
        programs = min(blocks, 8 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        programs = min(blocks, 2)
    _stage_rows_kernel[(programs,)](_bits(x), _bits(out), sorted_ids, num_post, M * top_k, top_k, H, x.stride(0),
                                    out.stride(0), programs, BLOCK_P=block_p, BLOCK_H=block_h, num_warps=4)
    return out


def stage_rows_torch(x: torch.Tensor, sorted_ids: torch.Tensor, num_post: torch.Tensor, top_k: int) -> torch.Tensor:
    """Reference: [num_post, H] of x's dtype, the rows stage_rows writes."""
    n = int(num_post.item())
    routes = sorted_ids[:n].long()
    ok = routes < x.shape[0] * top_k
    out = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device)
    out[ok] = x[routes[ok] // top_k]
    return out
