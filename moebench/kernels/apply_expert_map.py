"""Global -> local expert ids on one EP rank, keeping -1 as -1 (docs/contracts.md "apply_expert_map").

`apply_expert_map_oblivious` (also `apply_expert_map.oblivious`) is the code before the fix, `expert_map[topk_ids]`:
a -1 ("no expert", e.g. a masked padded row) indexes from the end and becomes the local id of the last expert, so on
the rank that owns that expert every padded slot turns into real work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device

__all__ = ["apply_expert_map", "apply_expert_map_torch", "apply_expert_map_oblivious",
           "apply_expert_map_oblivious_torch", "build_expert_map"]

# One elementwise pass: 2048 ids per program (4 warps, 16 per thread) keeps a 65536x8 input at ~256 programs
# (about two per SM, enough bytes in flight) and a 64x8 input at one program.
BLOCK = 2048
NUM_WARPS = 4


def build_expert_map(num_experts: int, ep_size: int = 1, rank: int = 0, *, local_experts: int | None = None,
                     generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [E] map for `rank`: it owns the L global experts [rank*L, (rank+1)*L), every other expert is -1.

    L is local_experts when given (e.g. rank 0 of a layer configured with fewer local experts), else E/ep_size
    (the contract's layout). With a generator the owned experts get their local ids in a random order (a placement
    other than the identity, so a kernel that ignores the map cannot pass); without, local id = global id - rank*L.
    """
    if local_experts is None:
        if ep_size < 1 or num_experts % ep_size or not 0 <= rank < ep_size:
            raise ValueError(f"bad EP layout: num_experts={num_experts}, ep_size={ep_size}, rank={rank}")
        local = num_experts // ep_size
    else:
        local = local_experts
        if local < 1 or rank < 0 or (rank + 1) * local > num_experts:
            raise ValueError(f"bad EP layout: num_experts={num_experts}, local_experts={local}, rank={rank}")
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    ids = torch.randperm(local, generator=generator) if generator is not None else torch.arange(local)
    expert_map[rank * local:(rank + 1) * local] = ids.to(torch.int32)
    return expert_map.to(device)


def apply_expert_map_torch(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Reference: int64 tensor of topk_ids' shape, expert_map[id] where 0 <= id < E, else -1 (new tensor).

    An id >= E (outside the contract's inputs) is treated like -1 rather than read out of bounds.
    """
    ids = topk_ids.to(torch.int64)
    num_experts = expert_map.numel()
    valid = (ids >= 0) & (ids < num_experts)
    local = expert_map.to(torch.int64)[ids.clamp(0, max(num_experts - 1, 0))]
    return torch.where(valid, local, torch.full_like(ids, -1))


@triton.jit
def _apply_expert_map_kernel(topk_ids_ptr, expert_map_ptr, out_ptr, num_elements, num_experts,
                             BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_elements
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    # Only a real expert id is ever used as an index; everything else reads nothing and yields -1.
    valid = in_range & (ids >= 0) & (ids < num_experts)
    local = tl.load(expert_map_ptr + tl.where(valid, ids, 0), mask=valid, other=-1)
    tl.store(out_ptr + offs, local.to(tl.int64), mask=in_range)


def apply_expert_map(topk_ids: torch.Tensor, expert_map: torch.Tensor, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: int64 local ids of topk_ids' shape, -1 kept. Never writes in place; `out` may be preallocated
    (int64, topk_ids' shape, not sharing memory with topk_ids)."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_map must be a 1-D int32 tensor, got {expert_map.dtype} {tuple(expert_map.shape)}")
    check_triton_device(topk_ids, expert_map)
    if out is None:
        out = torch.empty(topk_ids.shape, dtype=torch.int64, device=topk_ids.device)
    elif out.shape != topk_ids.shape or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 tensor of shape {tuple(topk_ids.shape)}")
    elif out.data_ptr() == topk_ids.data_ptr() and out.numel():
        raise ValueError("apply_expert_map never writes in place: out must not be topk_ids")
    n = topk_ids.numel()
    if n == 0:
        return out
    _apply_expert_map_kernel[(triton.cdiv(n, BLOCK),)](
        topk_ids.contiguous(), expert_map.contiguous(), out, n, expert_map.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def apply_expert_map_oblivious(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Before the fix: plain indexing, so -1 wraps to the last expert's entry (result has the map's dtype)."""
    return expert_map[topk_ids.long()]


def apply_expert_map_oblivious_torch(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Reference of the pre-fix behaviour, written independently: Python-style wrap of negative indices."""
    ids = topk_ids.to(torch.int64) % expert_map.numel()
    return expert_map.index_select(0, ids.flatten()).view(topk_ids.shape)


apply_expert_map.oblivious = apply_expert_map_oblivious  # type: ignore[attr-defined]
