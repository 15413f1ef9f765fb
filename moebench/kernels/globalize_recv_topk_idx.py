"""Neutralise a fixed-capacity receive buffer's ids and make them global (docs/contracts.md,
"globalize_recv_topk_idx").

After a no-host-sync dispatch (DeepEP V2 with do_expand=False, moebench's a2a_fixed) only the first `num_recv`
rows of the receive buffer were written; the rest hold whatever was in memory, often ids that look valid. The
kernel keeps `local + rank_expert_offset` only for slots that are local (>= 0), in range (< E) and in a written
row (< num_recv, read on the device, so the call can be captured in a CUDA graph); everything else becomes -1.

`globalize_recv_topk_idx_oblivious` (also `globalize_recv_topk_idx.oblivious`) is the code before the fix (the
`torch.where` the vLLM fix replaced): it adds the offset to every non-negative slot of every row, with no row or
range check, so stale rows are kept as if they had been received.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device

__all__ = ["globalize_recv_topk_idx", "globalize_recv_topk_idx_torch", "globalize_recv_topk_idx_oblivious",
           "globalize_oblivious_reference"]

BLOCK = 2048  # ids per program: one elementwise pass (see apply_expert_map for the sizing)
NUM_WARPS = 4


def _check_args(recv_topk_idx: torch.Tensor, num_recv: torch.Tensor) -> None:
    if recv_topk_idx.dim() != 2 or recv_topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"recv_topk_idx must be a 2-D int32/int64 tensor, got {recv_topk_idx.dtype} "
                         f"{tuple(recv_topk_idx.shape)}")
    if not recv_topk_idx.is_contiguous():
        raise ValueError("recv_topk_idx must be contiguous (it is updated in place)")
    if not isinstance(num_recv, torch.Tensor) or num_recv.numel() != 1 or \
            num_recv.dtype not in (torch.int32, torch.int64):
        raise ValueError("num_recv must be a 1-element int32 tensor on the device (read there, never on the host)")
    if num_recv.device != recv_topk_idx.device:
        raise ValueError(f"num_recv is on {num_recv.device}, recv_topk_idx on {recv_topk_idx.device}")


def globalize_recv_topk_idx_torch(recv_topk_idx: torch.Tensor, num_recv: torch.Tensor, rank_expert_offset: int,
                                  num_experts: int) -> torch.Tensor:
    """Reference, in place: keep val + offset iff val >= 0, val + offset < E and row < num_recv; else -1."""
    _check_args(recv_topk_idx, num_recv)
    val = recv_topk_idx.to(torch.int64)
    g = val + rank_expert_offset
    row = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device).unsqueeze(1)
    keep = (val >= 0) & (g < num_experts) & (row < num_recv.reshape(()).to(torch.int64))  # no host sync
    recv_topk_idx.copy_(torch.where(keep, g, torch.full_like(g, -1)))
    return recv_topk_idx


@triton.jit
def _globalize_recv_topk_idx_kernel(recv_ptr, num_recv_ptr, rank_expert_offset, num_experts, num_elements,
                                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_elements
    num_recv = tl.load(num_recv_ptr).to(tl.int64)  # on the device: graph replays follow its current value
    val = tl.load(recv_ptr + offs, mask=in_range, other=-1).to(tl.int64)
    g = val + rank_expert_offset
    keep = (val >= 0) & (g < num_experts) & (offs // TOP_K < num_recv)
    tl.store(recv_ptr + offs, tl.where(keep, g, -1).to(recv_ptr.dtype.element_ty), mask=in_range)


def globalize_recv_topk_idx(recv_topk_idx: torch.Tensor, num_recv: torch.Tensor, rank_expert_offset: int,
                            num_experts: int) -> torch.Tensor:
    """Triton, in place; returns recv_topk_idx. No host synchronisation (CUDA-graph capturable)."""
    _check_args(recv_topk_idx, num_recv)
    check_triton_device(recv_topk_idx, num_recv)
    n = recv_topk_idx.numel()
    if n == 0:
        return recv_topk_idx
    _globalize_recv_topk_idx_kernel[(triton.cdiv(n, BLOCK),)](
        recv_topk_idx, num_recv, int(rank_expert_offset), int(num_experts), n,
        TOP_K=recv_topk_idx.shape[1], BLOCK=BLOCK, num_warps=NUM_WARPS)
    return recv_topk_idx


def globalize_recv_topk_idx_oblivious(recv_topk_idx: torch.Tensor, num_recv: torch.Tensor | None,
                                      rank_expert_offset: int, num_experts: int) -> torch.Tensor:
    """Before the fix, in place: every row, every non-negative slot gets the offset; num_recv and E unused."""
    recv_topk_idx.copy_(torch.where(recv_topk_idx >= 0, recv_topk_idx + rank_expert_offset,
                                    torch.full_like(recv_topk_idx, -1)))
    return recv_topk_idx


def globalize_oblivious_reference(recv_topk_idx: torch.Tensor, rank_expert_offset: int) -> torch.Tensor:
    """Pre-fix result as a new tensor, written independently of the impl above."""
    return recv_topk_idx + rank_expert_offset * (recv_topk_idx >= 0).to(recv_topk_idx.dtype)


globalize_recv_topk_idx.oblivious = globalize_recv_topk_idx_oblivious  # type: ignore[attr-defined]
