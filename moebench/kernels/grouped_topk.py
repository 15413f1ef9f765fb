"""grouped_topk: the grouped (DeepSeek-V3 style) router (docs/contracts.md "Routers"), Triton kernel beside its torch
reference.

s = softmax(logits) or sigmoid(logits) in fp32, b = s + bias (or s). The E experts form `num_expert_group` equal
contiguous groups; a group's score is the sum of the top-2 of b in it when a bias is given, else the max of s.
The `topk_group` best groups are kept (ties to the lower group index), every other expert is masked to -inf, and
the `top_k` experts are picked by the masked b (ties to the lower expert index, slots in descending b). Weights are
the unbiased s at those ids, divided by their sum when `renormalize` (a zero sum is left as is), then multiplied by
`routed_scaling_factor` (whether or not renormalised, as vLLM's grouped_topk does). Padded rows: ids -1, weights 0.

The Triton kernel holds a block of rows as a 3-D tile of groups x rows x experts-per-group (both padded to powers
of two and masked), so the group scores are plain reductions over the last axis; the group and expert picks reuse
topk_softmax's int-key iterative arg-max (kernels/_details/router_tiles), two-pass or packed int64 as the router
config says (topk_softmax's docstring compares them). Non-finite s are clamped to 0 as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import next_pow2
from moebench.kernels._details.router_common import (
    check_router_args,
    mask_padded_rows_torch,
    renormalize_torch,
    router_config,
    router_launch_config,
    router_outputs,
    select_desc_torch,
    triton_router_operands,
    write_out,
    zero_non_finite_torch,
)
from moebench.kernels._details.router_tiles import (
    INT32_MIN,
    Q_AXIS,
    orderable_key,
    INT64_MIN,
    pack_keys,
    pick_topk,
    row_reduce_max,
    row_reduce_sum,
    rows_to_tile,
    slice_index,
    slot_tile,
    store_rows,
    zero_non_finite,
)

__all__ = ["grouped_topk", "grouped_topk_torch", "grouped_topk_scores_torch", "grouped_args_problem", "SCORINGS"]

SCORINGS = ("softmax", "sigmoid")


def grouped_args_problem(num_experts: int, top_k: int, num_expert_group: int, topk_group: int, scoring: str,
                         has_bias: bool) -> str | None:
    """Why these grouped-router arguments are impossible, or None."""
    if scoring not in SCORINGS:
        return f"scoring: {scoring!r} is not one of {', '.join(SCORINGS)}"
    if num_expert_group < 1 or num_experts % num_expert_group:
        return f"num_expert_group: {num_expert_group} does not divide num_experts {num_experts}"
    if not 1 <= topk_group <= num_expert_group:
        return f"topk_group: must be in [1, num_expert_group={num_expert_group}], got {topk_group}"
    group_size = num_experts // num_expert_group
    if top_k > topk_group * group_size:
        return f"top_k: {top_k} > {topk_group * group_size} experts in the {topk_group} kept groups"
    if has_bias and group_size < 2:
        return f"num_expert_group: the top-2 group score with a bias needs >= 2 experts per group, got {group_size}"
    return None


def check_grouped_args(logits, top_k, num_expert_group, topk_group, scoring, bias, is_padding):
    num_tokens, num_experts = check_router_args(logits, top_k, is_padding, bias)
    why = grouped_args_problem(num_experts, top_k, num_expert_group, topk_group, scoring, bias is not None)
    if why:
        raise ValueError(why)
    return num_tokens, num_experts


# ---------------------------------------------------------------------------------------------------------------
# Reference (eager torch, docs/contracts.md literally)
# ---------------------------------------------------------------------------------------------------------------

def grouped_topk_scores_torch(logits: torch.Tensor, num_expert_group: int, scoring: str = "softmax",
                              bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, b, group scores [T, G]) of the reference."""
    x = logits.float()
    s = zero_non_finite_torch(torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x))
    b = s + bias.float() if bias is not None else s
    num_tokens, num_experts = x.shape
    grouped = b.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if bias is not None:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # top-2 values: which of equal ones is moot
    else:
        group_scores = grouped.amax(dim=-1)
    return s, b, group_scores


def grouped_topk_torch(logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int,
                       scoring: str = "softmax", bias: torch.Tensor | None = None, renormalize: bool = True,
                       routed_scaling_factor: float = 1.0, is_padding: torch.Tensor | None = None, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference grouped router: (weights fp32 [T, K], ids int32 [T, K])."""
    num_tokens, num_experts = check_grouped_args(logits, top_k, num_expert_group, topk_group, scoring, bias,
                                                  is_padding)
    if out is not None:
        router_outputs(num_tokens, top_k, logits.device, out)
    s, b, group_scores = grouped_topk_scores_torch(logits, num_expert_group, scoring, bias)
    kept = select_desc_torch(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_expert_group, dim=1)
    masked = b.masked_fill(~expert_mask, float("-inf"))
    ids = select_desc_torch(masked, top_k)
    weights = s.gather(1, ids)
    if renormalize:
        weights = renormalize_torch(weights)
    weights = weights * routed_scaling_factor
    ids = ids.to(torch.int32)
    mask_padded_rows_torch(weights, ids, is_padding)
    return write_out(weights, ids, out)


# ---------------------------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_tokens"])
def _grouped_topk_kernel(logits_ptr, bias_ptr, pad_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits,
                         routed_scaling_factor,
                         G: tl.constexpr, GS: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PAD: tl.constexpr,
                         RENORMALIZE: tl.constexpr, Q_AXIS: tl.constexpr, PACKED: tl.constexpr):
    # Tile: groups (slice axis Q_AXIS) x rows x members; the groups of a row stay inside each thread (see
    # router_tiles.Q_AXIS), so the group scores are per-thread reductions plus a few lanes.
    NONE: tl.constexpr = G_PAD * GS_PAD
    PADDED: tl.constexpr = (G != G_PAD) or (GS != GS_PAD)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < num_tokens
    live = in_range
    if HAS_PAD:
        live = in_range & (tl.load(pad_ptr + rows, mask=in_range, other=1) == 0)
    row_base = logits_ptr + rows.to(tl.int64) * stride_logits
    group = slice_index(G_PAD, Q_AXIS)
    member = tl.arange(0, GS_PAD)[None, None, :]
    valid = (group < G) & (member < GS)
    live3 = rows_to_tile(live, Q_AXIS)
    if PADDED:
        experts = tl.where(valid, group * GS + member, NONE)
        x = tl.load(rows_to_tile(row_base, Q_AXIS) + experts, mask=live3 & valid, other=0.0).to(tl.float32)
    else:  # no padding anywhere: plain contiguous addresses and no column mask, so the loads stay 16-byte vectors
        experts = group * GS + member
        x = tl.load(rows_to_tile(row_base, Q_AXIS) + experts, mask=live3, other=0.0).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        if PADDED:
            x = tl.where(valid, x, float("-inf"))
        row_max = row_reduce_max(x, Q_AXIS)
        e = tl.exp(x - rows_to_tile(row_max, Q_AXIS))
        inv_sum = 1.0 / row_reduce_sum(e, Q_AXIS)
        s = e * rows_to_tile(inv_sum, Q_AXIS)
    # NaN scores (a NaN logit; for softmax also +Inf, or a row of -Inf) are clamped to 0, as in the reference
    s = zero_non_finite(s)
    if HAS_BIAS:
        # loaded at the tile's full shape (every row re-reads the same L1-resident bias) so that the load gets the
        # tile's layout; a load of the bias alone gets a layout of its own and drags the selection into it
        bias_ptrs = bias_ptr + experts + 0 * rows_to_tile(rows, Q_AXIS)
        if PADDED:
            b = s + tl.load(bias_ptrs, mask=valid, other=0.0).to(tl.float32)
        else:
            b = s + tl.load(bias_ptrs).to(tl.float32)
    else:
        b = s
    if PADDED:
        b = tl.where(valid, b, float("-inf"))

    # group scores (2-D: the tile without its member axis) and the kept groups
    if HAS_BIAS:
        # sum of the top-2 values (a maximum that occurs twice counts twice, as in topk(2).values)
        hi = tl.max(b, 2)
        at_hi = b == tl.expand_dims(hi, 2)
        runner_up = tl.max(tl.where(at_hi, float("-inf"), b), 2)
        group_score = hi + tl.where(tl.sum(at_hi.to(tl.int32), 2) > 1, hi, runner_up)
    else:
        group_score = tl.max(b, 2)
    gcols = tl.expand_dims(tl.arange(0, G_PAD), 1 - Q_AXIS)
    group_key = orderable_key(tl.where(gcols < G, group_score, float("-inf")))
    kept = (gcols < 0) & (tl.expand_dims(rows, Q_AXIS) < 0)  # all False, the shape of group_score
    if PACKED:
        packed = pack_keys(group_key, gcols, G_PAD)  # one reduction per kept group (see pick_topk_packed_3d)
        for _ in tl.static_range(TOPK_GROUP):
            hit = packed == tl.expand_dims(tl.max(packed, Q_AXIS), Q_AXIS)
            kept = kept | hit
            packed = tl.where(hit, INT64_MIN, packed)
    else:
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_key, Q_AXIS)
            first = tl.min(tl.where(group_key == tl.expand_dims(best, Q_AXIS), gcols, G_PAD), Q_AXIS)
            hit = gcols == tl.expand_dims(first, Q_AXIS)
            kept = kept | hit
            group_key = tl.where(hit, INT32_MIN, group_key)

    masked = tl.where(tl.expand_dims(kept, 2), b, float("-inf"))
    ids = pick_topk(orderable_key(masked), experts, K, K_PAD, NONE, Q_AXIS, PACKED)

    # weights: the unbiased s at the picked ids, recomputed from the gathered logits the same way
    slot_ok = slot_tile(BLOCK_T, K_PAD, Q_AXIS) < K
    xg = tl.load(rows_to_tile(row_base, Q_AXIS) + ids, mask=live3 & slot_ok, other=0.0).to(tl.float32)
    if SIGMOID:
        w = 1.0 / (1.0 + tl.exp(-xg))
    else:
        w = tl.exp(xg - rows_to_tile(row_max, Q_AXIS)) * rows_to_tile(inv_sum, Q_AXIS)
    w = zero_non_finite(w)
    store_rows(ids_ptr, weights_ptr, ids, w, rows, in_range, live, K, K_PAD, RENORMALIZE, routed_scaling_factor,
               Q_AXIS)


def grouped_topk(logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int, scoring: str = "softmax",
                 bias: torch.Tensor | None = None, renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 is_padding: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 config: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton grouped router: (weights fp32 [T, K], ids int32 [T, K]); see the module docstring.

    config: as topk_softmax's (router_common.RouterConfig); outputs do not depend on it."""
    num_tokens, num_experts = check_grouped_args(logits, top_k, num_expert_group, topk_group, scoring, bias,
                                                  is_padding)
    logits, bias, weights, ids = triton_router_operands(logits, top_k, num_experts, is_padding, bias, out)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // num_expert_group
    g_pad, gs_pad = next_pow2(num_expert_group), next_pow2(group_size)
    cfg = router_config(config)
    block_t, num_warps = (router_launch_config(g_pad * gs_pad) if config is None
                          else cfg.launch(g_pad * gs_pad))
    grid = (triton.cdiv(num_tokens, block_t),)
    _grouped_topk_kernel[grid](
        logits, bias if bias is not None else logits,
        is_padding.view(torch.uint8) if is_padding is not None else logits,
        weights, ids, num_tokens, logits.stride(0), float(routed_scaling_factor),
        G=num_expert_group, GS=group_size, G_PAD=g_pad, GS_PAD=gs_pad, TOPK_GROUP=topk_group,
        K=top_k, K_PAD=next_pow2(top_k), BLOCK_T=block_t, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=bias is not None, HAS_PAD=is_padding is not None, RENORMALIZE=bool(renormalize),
        Q_AXIS=Q_AXIS, PACKED=cfg.selection == "packed64", num_warps=num_warps)
    return weights, ids
