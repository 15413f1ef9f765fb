"""The alignment bench family: moe_align_block_size (target "kernel", NVTX stage "align"), on EP rank 0's expert
map when not every expert is local. `.triton` launches the point's `config` (a candidate of the kernel's table,
else the tuned table's entry, else the rule) and records which."""

from __future__ import annotations

import torch

from moebench.check import CheckResult, compare_exact, poison
from moebench.families import KernelFamily, register_family
from moebench.inputs import make_batch, route
from moebench.kernels.apply_expert_map import build_expert_map
from moebench.kernels.moe_align_block_size import (
    align_capacity,
    align_choice,
    align_workspace,
    alloc_align_outputs,
    capacity_fits_int32,
    local_expert_ids_torch,
    moe_align_block_size,
    moe_align_block_size_torch,
)
from moebench.measure.cost import PointWork, align_programs, id_work
from moebench.registry import Case, Routing, register_variants, declare_work

__all__ = ["rank0_expert_map", "align_problem", "canonical_alignment", "align_build_for"]


def rank0_expert_map(p, device) -> tuple[torch.Tensor | None, int]:
    """(expert_map, local_experts) of EP rank 0, which owns global experts [0, L); no map when L == E."""
    local = p.local_experts
    if local == p.num_experts:
        return None, p.num_experts
    return build_expert_map(p.num_experts, local_experts=local, device=device), local


def canonical_alignment(got, num_routes: int, num_experts: int, block_size: int
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[str]]:
    """An outside alignment's (sorted_token_ids, expert_ids, num_tokens_post_padded) in moebench's layout, plus the
    problems no layout change can excuse.

    Layout only: within an expert's blocks the order of its routes is free (the GEMM does not care, atomics-based
    kernels do not keep it), slots >= num_routes are pads (the GEMM masks them), blocks of an expert id outside
    [0, num_experts) (a dump bucket for skipped routes) are dropped from the count, and nothing after
    num_tokens_post_padded is read. The result is then compared exactly with the reference, so a missing,
    duplicated or misfiled route, a wrong block count, or a negative (unwritten) slot still fails.
    """
    sorted_ids, expert_ids, num_post = (t.reshape(-1).cpu().to(torch.int64) for t in got)
    capacity, num_m_blocks = align_capacity(num_routes, num_experts, block_size)
    problems = []
    used = int(num_post[0]) // block_size if num_post.numel() else 0
    if used > min(expert_ids.numel(), sorted_ids.numel() // block_size):
        return (sorted_ids, expert_ids, num_post), [f"num_tokens_post_padded {int(num_post[0])} exceeds the buffers"]
    owners = expert_ids[:used]
    slots = sorted_ids[:used * block_size].view(used, block_size)
    kept = (owners >= 0) & (owners < num_experts)
    slots, owners = slots[kept], owners[kept]
    if bool((slots < 0).any()):
        problems.append(f"sorted_token_ids: {int((slots < 0).sum())} negative (unwritten?) slots in used blocks")
    owner_of_slot = owners.repeat_interleave(block_size)
    flat = slots.reshape(-1)
    real = (flat >= 0) & (flat < num_routes)
    order = torch.argsort(owner_of_slot[real] * (num_routes + 1) + flat[real])
    tokens, experts = flat[real][order], owner_of_slot[real][order]
    counts = torch.bincount(experts, minlength=num_experts)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    if int(padded.sum()) != int(kept.sum()) * block_size:
        problems.append(f"{int(kept.sum())} blocks used where the routes need {int(padded.sum()) // block_size}")
    seg_start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(tokens.numel()) - first[experts]
    out_sorted = torch.full((capacity,), num_routes, dtype=torch.int32)
    out_sorted[seg_start[experts] + rank] = tokens.to(torch.int32)
    out_experts = torch.full((num_m_blocks,), -1, dtype=torch.int32)
    blocks = padded // block_size
    out_experts[:int(blocks.sum())] = torch.repeat_interleave(torch.arange(num_experts), blocks).to(torch.int32)
    out_post = torch.tensor([int(padded.sum())], dtype=torch.int32)
    return (out_sorted, out_experts, out_post), problems


def _build_align(variant: str, fn=None, canonical: bool = False):
    def build(p, ctx):
        batch = make_batch(p, ctx.device, need_hidden=False)
        _, topk_ids = route(p, batch)
        num_routes = topk_ids.numel()
        expert_map, num_experts = rank0_expert_map(p, ctx.device)
        oblivious = variant == "oblivious"
        ref = moe_align_block_size_torch(topk_ids, num_experts, p.block_size, expert_map, wrap_negative=oblivious)
        out = alloc_align_outputs(num_routes, num_experts, p.block_size, ctx.device)
        config = p.config if variant == "triton" else None  # the twin and the peers keep the default launch
        workspace = align_workspace(num_routes, num_experts, ctx.device, config=config)

        if variant == "fn":
            def run():
                return fn(topk_ids, num_experts, p.block_size, expert_map, out=out)
        elif variant == "torch":
            def run():
                return moe_align_block_size_torch(topk_ids, num_experts, p.block_size, expert_map)
        else:
            def run():
                return moe_align_block_size(topk_ids, num_experts, p.block_size, expert_map, out=out,
                                            workspace=workspace, wrap_negative=oblivious, config=config)

        def check():
            for t in (*out, workspace):
                poison(t)
            got = run()
            problems: list[str] = []
            if canonical:
                got, problems = canonical_alignment(got, num_routes, num_experts, p.block_size)
                got = tuple(t.to(r.device) for t, r in zip(got, ref))
            return CheckResult.merge(*(compare_exact(name, g, r) for name, g, r in
                                       zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, ref)),
                                     *(CheckResult(False, why, {}) for why in problems))

        info = {"num_local_experts": num_experts, "num_tokens_post_padded": int(ref[2].item())}
        if variant in ("triton", "oblivious"):  # the launch the Triton kernels take (the same function picks it)
            info.update(align_choice(num_routes, num_experts, ctx.device, config).record())
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
register_variants("moe_align_block_size", _DESCRIPTIONS, _build_align, validate=align_problem,
                  tuned_kernel="moe_align_block_size")


def align_build_for(fn, *, canonical: bool = False):
    """build(p, ctx) of `fn` called like moebench's alignment; canonical=True judges its output after
    `canonical_alignment` (for library kernels whose layout differs only in what that function normalises)."""
    return _build_align("fn", fn, canonical)


register_family(KernelFamily(
    "moe_align_block_size", ("kernel",), align_build_for,
    "fn(topk_ids int32 [T,K] (-1 skipped), num_experts (local), block_size, expert_map int32 [E] or None, "
    "out=(sorted_token_ids, expert_ids, num_tokens_post_padded)) -> those three int32 tensors, moebench's layout",
    align_problem))
declare_work("moe_align_block_size", PointWork(call=id_work, launches=3,  # count, scan, scatter
                                              programs=lambda p: align_programs(p.num_tokens * p.top_k)))
