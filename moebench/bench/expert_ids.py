"""The expert-id bench family: apply_expert_map (global -> local ids on one EP rank) and globalize_recv_topk_idx
(a fixed-capacity receive buffer's ids made global), both target "kernel"; plus the receive buffer a no-sync
dispatch leaves behind, which the globalize cases are built on."""

from __future__ import annotations

import torch

from moebench.check import CheckResult, compare_exact, poison
from moebench.dispatch.pack import CapacityKnobs
from moebench.families import KernelFamily, register_family
from moebench.inputs import generator, make_batch, route
from moebench.kernels.apply_expert_map import (
    apply_expert_map,
    apply_expert_map_oblivious,
    apply_expert_map_oblivious_torch,
    apply_expert_map_torch,
    build_expert_map,
)
from moebench.kernels.globalize_recv_topk_idx import (
    globalize_oblivious_reference,
    globalize_recv_topk_idx,
    globalize_recv_topk_idx_oblivious,
    globalize_recv_topk_idx_torch,
)
from moebench.params import EPLayout
from moebench.measure.cost import PointWork, id_work
from moebench.registry import Case, Routing, RunContext, register_variants, declare_work

__all__ = ["rows_differing", "make_receive_buffer"]


def rows_differing(result: torch.Tensor, truth: torch.Tensor) -> int:
    """Rows in which any local id differs from the mask-aware result."""
    return int((result.to(torch.int64) != truth.to(torch.int64)).reshape(result.shape[0], -1).any(dim=1).sum())


def make_receive_buffer(local_ids: torch.Tensor, capacity: int, local_experts: int, *,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A receive buffer as a no-sync dispatch leaves it: (recv [capacity, K] int64, num_recv int32 [1]).

    Rows `< len(local_ids)` hold the received local ids; the rest hold garbage that looks valid (ids in
    [0, local_experts) with some -1), as stale memory from an earlier step would.
    """
    num_recv, K = local_ids.shape
    if num_recv > capacity:
        raise ValueError(f"{num_recv} received rows do not fit a capacity of {capacity}")
    device = local_ids.device
    recv = torch.randint(-1, local_experts, (capacity, K), generator=generator, device=generator.device,
                         dtype=torch.int64).to(device)
    recv[:num_recv] = local_ids.to(torch.int64)
    return recv, torch.tensor([num_recv], dtype=torch.int32, device=device)

# ---------------------------------------------------------------------------------------------------------------
# apply_expert_map
# ---------------------------------------------------------------------------------------------------------------

def _apply_map_build(variant: str, fn=None):
    """build(p, ctx) of a variant, or (variant "fn") of `fn` called like the Triton one."""
    def build(p, ctx: RunContext) -> Case:
        batch = make_batch(p, ctx.device, need_hidden=False)
        _, topk_ids = route(p, batch)  # -1 on padded rows when p.mask
        # The last rank owns the last expert: there a wrapped -1 lands on a real local expert (on rank 0 with
        # ep_size > 1 it would land on a non-local -1 and hide the bug).
        rank = p.ep_size - 1
        expert_map = build_expert_map(p.num_experts, p.ep_size, rank, generator=generator(p.seed + 17, "cpu"),
                                      device=ctx.device)
        out = torch.empty(topk_ids.shape, dtype=torch.int64, device=ctx.device)

        if variant == "fn":
            def run():
                return fn(topk_ids, expert_map, out=out)
        elif variant == "triton":
            def run():
                return apply_expert_map(topk_ids, expert_map, out=out)
        elif variant == "oblivious":
            def run():
                return apply_expert_map_oblivious(topk_ids, expert_map)
        else:
            def run():
                return apply_expert_map_torch(topk_ids, expert_map)

        reference = apply_expert_map_oblivious_torch if variant == "oblivious" else apply_expert_map_torch

        def check() -> CheckResult:
            if variant in ("triton", "fn"):
                poison(out)
            got = run()
            ref = reference(topk_ids, expert_map)
            if variant == "torch":  # the reference against its own CPU run
                ref = reference(topk_ids.cpu(), expert_map.cpu())
            return compare_exact("local_ids", got, ref)

        _, true_ids = route(p, batch, use_mask=True)
        result, truth = reference(topk_ids, expert_map), apply_expert_map_torch(true_ids, expert_map)
        corrupted = rows_differing(result, truth)
        misrouted = int((result.to(torch.int64) != truth.to(torch.int64)).sum())  # slots sent to a wrong expert
        out_bytes = 8 if variant != "oblivious" else expert_map.element_size()
        return Case(run=run, check=check,
                    bytes_moved=topk_ids.numel() * (topk_ids.element_size() + out_bytes)
                    + expert_map.numel() * expert_map.element_size(),
                    bytes_note="ids read + local ids written + the map once",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size),
                    info={"corrupted_rows": corrupted, "misrouted_routes": misrouted, "rank": rank},
                    nvtx_stage="expert_map")
    return build


_MAP_DESCRIPTIONS = {
    "triton": "global -> local expert ids, -1 kept (one elementwise Triton kernel)",
    "torch": "eager torch reference: where(id >= 0, expert_map[clamped id], -1)",
    "oblivious": "expert_map[topk_ids] before the fix: -1 wraps to the last expert",
}
register_variants("apply_expert_map", _MAP_DESCRIPTIONS, _apply_map_build)
register_family(KernelFamily(
    "apply_expert_map", ("kernel",), lambda fn: _apply_map_build("fn", fn),
    "fn(topk_ids int32 [T,K] (-1 on padded rows), expert_map int32 [E], out=int64 [T,K]) -> int64 local ids "
    "[T,K], -1 kept (never in place)"))


# ---------------------------------------------------------------------------------------------------------------
# globalize_recv_topk_idx
# ---------------------------------------------------------------------------------------------------------------

def _globalize_build(variant: str, fn=None):
    """build(p, ctx) of a variant, or (variant "fn") of `fn` called like the Triton one (in place)."""
    def build(p, ctx: RunContext) -> Case:
        batch = make_batch(p, ctx.device, need_hidden=False)
        _, topk_ids = route(p, batch)  # -1 on padded rows when p.mask
        # This rank receives every row with at least one expert it owns, as local ids (-1 for the others).
        layout = EPLayout.of(p, rank=p.ep_size - 1)  # the last rank: a non-zero offset whenever ep_size > 1
        local_experts, offset = layout.local_experts, layout.expert_offset
        ids = topk_ids.to(torch.int64)
        is_local = (ids >= offset) & (ids < offset + local_experts)
        local_ids = torch.where(is_local, ids - offset, torch.full_like(ids, -1))
        local_ids = local_ids[is_local.any(dim=1)]  # host sync: build time only
        capacity = max(p.knobs(CapacityKnobs).num_max_tokens_per_rank, local_ids.shape[0])
        source, num_recv = make_receive_buffer(local_ids, capacity, local_experts,
                                               generator=generator(p.seed + 29, "cpu"))
        buf = source.clone()

        if variant == "fn":
            def run():
                return fn(buf, num_recv, offset, p.num_experts)
        elif variant == "triton":
            def run():
                return globalize_recv_topk_idx(buf, num_recv, offset, p.num_experts)
        elif variant == "oblivious":
            def run():
                return globalize_recv_topk_idx_oblivious(buf, num_recv, offset, p.num_experts)
        else:
            def run():
                return globalize_recv_topk_idx_torch(buf, num_recv, offset, p.num_experts)

        def reference(src: torch.Tensor) -> torch.Tensor:
            if variant == "oblivious":
                return globalize_oblivious_reference(src, offset)
            return globalize_recv_topk_idx_torch(src.clone(), num_recv.to(src.device), offset, p.num_experts)

        def check() -> CheckResult:
            buf.copy_(source)  # in place: the garbage tail doubles as the poison
            run()
            ref = reference(source.cpu() if variant == "torch" else source)
            return compare_exact("recv_topk_idx", buf, ref.to(buf.device))

        truth = globalize_recv_topk_idx_torch(source.clone(), num_recv, offset, p.num_experts)
        result = reference(source)
        corrupted = int((result != truth).any(dim=1).sum())
        # stale rows' slots left holding an expert id: what an expert-list scan of every row picks up
        polluted = int((result[int(local_ids.shape[0]):] >= 0).sum())
        return Case(run=run, check=check, bytes_moved=2 * buf.numel() * buf.element_size() + 4,
                    bytes_note="receive buffer read and written in place (repeated runs re-process the result)",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size),
                    info={"corrupted_rows": corrupted, "polluted_routes": polluted,
                          "num_recv": int(local_ids.shape[0]), "capacity": capacity,
                          "rank": layout.rank},
                    nvtx_stage="globalize")
    return build


_GLOBALIZE_DESCRIPTIONS = {
    "triton": "receive-buffer ids -> global, rows >= num_recv (read on device) and bad ids -> -1",
    "torch": "eager torch reference of the same (in place, no host sync)",
    "oblivious": "before the fix: offset added to every row's non-negative ids, stale rows kept",
}
register_variants("globalize_recv_topk_idx", _GLOBALIZE_DESCRIPTIONS, _globalize_build)
register_family(KernelFamily(
    "globalize_recv_topk_idx", ("kernel",), lambda fn: _globalize_build("fn", fn),
    "fn(recv_topk_idx int64 [capacity,K], num_recv int32 [1] on the device, rank_expert_offset, num_experts) -> "
    "recv_topk_idx updated in place (rows >= num_recv and bad ids -> -1, no host sync)"))
# one elementwise kernel over the ids (blocks of 1024); the oblivious twins are plain torch indexing
declare_work("apply_expert_map", PointWork(call=id_work, programs=lambda p: 1 + p.num_tokens * p.top_k / 1024,
                                          torch_variants=("oblivious",)))
declare_work("globalize_recv_topk_idx", PointWork(call=id_work, programs=lambda p: 1 + p.num_tokens * p.top_k / 1024,
                                                 torch_variants=("oblivious",)))
