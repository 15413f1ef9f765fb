"""The alignment bench family: moe_align_block_size (target "kernel", NVTX stage "align"), on EP rank 0's expert
map when not every expert is local."""

from __future__ import annotations

import torch

from moebench.check import CheckResult, compare_exact, poison
from moebench.inputs import make_batch, route
from moebench.kernels.apply_expert_map import build_expert_map
from moebench.kernels.moe_align_block_size import (
    align_capacity,
    align_workspace,
    alloc_align_outputs,
    capacity_fits_int32,
    local_expert_ids_torch,
    moe_align_block_size,
    moe_align_block_size_torch,
)
from moebench.registry import Case, Routing, register_impl

__all__ = ["rank0_expert_map", "align_problem"]


def rank0_expert_map(p, device) -> tuple[torch.Tensor | None, int]:
    """(expert_map, num_local_experts) of EP rank 0, which owns global experts [0, L); no map when L == E."""
    local = p.local_experts
    if local == p.num_experts:
        return None, p.num_experts
    return build_expert_map(p.num_experts, num_local_experts=local, device=device), local


def _build_align(variant: str):
    def build(p, ctx):
        batch = make_batch(p, ctx.device, need_hidden=False)
        _, topk_ids = route(p, batch)
        num_routes = topk_ids.numel()
        expert_map, num_experts = rank0_expert_map(p, ctx.device)
        oblivious = variant == "oblivious"
        ref = moe_align_block_size_torch(topk_ids, num_experts, p.block_size, expert_map, wrap_negative=oblivious)
        out = alloc_align_outputs(num_routes, num_experts, p.block_size, ctx.device)
        workspace = align_workspace(num_routes, num_experts, ctx.device)

        if variant == "torch":
            def run():
                return moe_align_block_size_torch(topk_ids, num_experts, p.block_size, expert_map)
        else:
            def run():
                return moe_align_block_size(topk_ids, num_experts, p.block_size, expert_map, out=out,
                                            workspace=workspace, wrap_negative=oblivious)

        def check():
            for t in (*out, workspace):
                poison(t)
            got = run()
            return CheckResult.merge(*(compare_exact(name, g, r) for name, g, r in
                                       zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, ref)))

        info = {"num_local_experts": num_experts, "num_tokens_post_padded": int(ref[2].item())}
        routing_ids = topk_ids
        if oblivious:
            masked = local_expert_ids_torch(topk_ids, num_experts, expert_map, wrap_negative=False)
            wrapped = local_expert_ids_torch(topk_ids, num_experts, expert_map, wrap_negative=True)
            info["corrupted_routes"] = int(((wrapped >= 0) & (masked < 0)).sum().item())
            # The routing this path effectively uses: -1 indexes the last global expert.
            routing_ids = torch.where((topk_ids < 0) & (topk_ids >= -p.num_experts), topk_ids + p.num_experts,
                                      topk_ids)
        map_bytes = expert_map.numel() * expert_map.element_size() if expert_map is not None else 0
        out_bytes = sum(t.numel() * t.element_size() for t in out)
        return Case(run=run, check=check,
                    bytes_moved=num_routes * topk_ids.element_size() + map_bytes + out_bytes,
                    bytes_note="ids (+ expert map) read once, three outputs written once",
                    routing=Routing(routing_ids, batch.is_padding, p.num_experts, p.ep_size),
                    info=info, nvtx_stage="align")
    return build


def align_problem(p) -> str | None:
    """Why a point is impossible for the alignment kernels, or None."""
    capacity, _ = align_capacity(p.num_tokens * p.top_k, p.local_experts, p.block_size)
    if not capacity_fits_int32(capacity):
        return f"block_size: capacity {capacity} of sorted_token_ids overflows int32"
    return None


_DESCRIPTIONS = {
    "triton": "Triton count/scan/scatter alignment; skips -1, out-of-range and non-local ids",
    "torch": "eager torch stable argsort + counting (the reference)",
    "oblivious": "pre-fix: -1 indexes the last expert, so padded routes pile onto it (same Triton kernels)",
}
for _variant, _text in _DESCRIPTIONS.items():
    register_impl(f"moe_align_block_size.{_variant}", targets=("kernel",), description=_text, validate=align_problem,
                  twin_of="moe_align_block_size.triton" if _variant == "oblivious" else None,
                  baseline=_variant == "torch")(_build_align(_variant))
