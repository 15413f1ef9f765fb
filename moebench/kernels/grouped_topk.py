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

Under a "cand<M>" config (topk_softmax's docstring) with 2..8 groups, `_grouped_topk_cand_kernel` holds the 8 levels
as the groups (level v = group v, padded members and groups masked): a group's score is one or three integer
REDUX reductions of its level's exact orderable keys (the max; with a bias the max, the count at the max and the
runner-up: values only, no ids), the kept groups come from one 19-comparator sort of 8 coarse group keys (score key
with its low 3 bits replaced by 7 - group: kept = at or above the topk_group-th, exact when that one truncates
strictly above the next, else the row fails), the dropped groups' experts are masked to -inf, and the experts are
picked, resolved and verified as in topk_softmax's cand kernel. Any failed live row (e.g. tied group scores: a
constant row) sends the program to the two-pass selection (`grouped_rows`). Other group counts run the two-pass
kernel under every config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details import router_cand
from moebench.kernels._details.jit import next_pow2
from moebench.kernels._details.router_cand import (
    add_bias,
    cand_geometry,
    coarse_key,
    exact_pick_2d,
    group_coarse,
    group_score_key,
    nth_of_8,
    pick_candidates,
    row_max_8,
    row_sum_8,
    sort8_desc,
    store_rows_2d,
)
from moebench.kernels._details.router_common import (
    check_router_args,
    mask_padded_rows_torch,
    register_router_tunable,
    renormalize_torch,
    router_choice,
    router_outputs,
    select_desc_torch,
    triton_router_operands,
    write_out,
    zero_non_finite_torch,
)
from moebench.kernels._details.router_tiles import (
    INT32_MIN,
    INT64_MIN,
    Q_AXIS,
    orderable_key,
    pack_keys,
    pick_topk,
    program_rows,
    row_reduce_max,
    row_reduce_sum,
    rows_to_tile,
    slice_index,
    slot_tile,
    store_rows,
    zero_non_finite,
)
from moebench.kernels._details.tuning import Choice, pow2_bucket

__all__ = ["grouped_topk", "grouped_topk_torch", "grouped_topk_scores_torch", "grouped_args_problem", "SCORINGS",
           "grouped_choice"]

register_router_tunable("grouped_topk", lambda num_tokens, num_experts, top_k, num_expert_group:
                        f"T={pow2_bucket(num_tokens)},E={num_experts},K={top_k},G={num_expert_group}")


def grouped_choice(num_tokens: int, num_experts: int, top_k: int, num_expert_group: int, device=None,
                   config=None) -> Choice:
    """grouped_topk's launch config on `device`: `config`, else the tuned table (bucket
    T=next_pow2(tokens),E,K,G), else the rule (router_common.DEFAULT_ROUTER_CONFIG)."""
    return router_choice("grouped_topk", device, config, num_tokens=num_tokens, num_experts=num_experts,
                         top_k=top_k, num_expert_group=num_expert_group)

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
    rows, in_range, live = program_rows(pad_ptr, num_tokens, BLOCK_T, HAS_PAD)
    grouped_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, rows, in_range, live, stride_logits,
                 routed_scaling_factor, G, GS, G_PAD, GS_PAD, TOPK_GROUP, K, K_PAD, BLOCK_T, SIGMOID, HAS_BIAS,
                 RENORMALIZE, Q_AXIS, PACKED)


@triton.jit
def grouped_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, rows, in_range, live, stride_logits,
                 routed_scaling_factor, G: tl.constexpr, GS: tl.constexpr, G_PAD: tl.constexpr,
                 GS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                 Q_AXIS: tl.constexpr, PACKED: tl.constexpr):
    """The two-pass (or packed) grouped selection of a block of rows, written to the outputs.

    Tile: groups (slice axis Q_AXIS) x rows x members; the groups of a row stay inside each thread (see
    router_tiles.Q_AXIS), so the group scores are per-thread reductions plus a few lanes."""
    NONE: tl.constexpr = G_PAD * GS_PAD
    PADDED: tl.constexpr = (G != G_PAD) or (GS != GS_PAD)
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


@triton.jit
def group_level(x, lane, rm2, inv2, bias_ptr, V: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Level V of the cand tile = group V: (b, expert ids, valid) from its logits x (the softmax's row max and
    1 / sum in rm2 / inv2)."""
    expert = V * GS + lane
    valid = (lane < GS) & (V < G)
    return add_bias(activate(x, rm2, inv2, SIGMOID), bias_ptr, expert, valid, HAS_BIAS), expert, valid


@triton.jit
def activate(x, rm2, inv2, SIGMOID: tl.constexpr):
    """s = sigmoid(x) or exp(x - row max) / row sum, non-finite clamped: the tile's and the candidates' ops."""
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        s = tl.exp(x - rm2) * inv2
    return zero_non_finite(s)


@triton.jit
def level_logits(base2, live2, lane, V: tl.constexpr, G: tl.constexpr, GS: tl.constexpr):
    expert = V * GS + lane
    valid = (lane < GS) & (V < G)
    return tl.where(valid, tl.load(base2 + expert, mask=live2 & valid, other=0.0).to(tl.float32), float("-inf"))


@triton.jit
def masked_level_key(b, expert, valid, kept, B: tl.constexpr, CA: tl.constexpr):
    return coarse_key(tl.where(tl.expand_dims(kept, CA), b, float("-inf")), expert, valid, B)


@triton.jit(do_not_specialize=["num_tokens"])
def _grouped_topk_cand_kernel(logits_ptr, bias_ptr, pad_ptr, weights_ptr, ids_ptr, flags_ptr, num_tokens,
                              stride_logits, routed_scaling_factor, G: tl.constexpr, GS: tl.constexpr,
                              G_PAD: tl.constexpr, GS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                              K: tl.constexpr, K_PAD: tl.constexpr, C: tl.constexpr, LANES: tl.constexpr,
                              B: tl.constexpr, BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                              HAS_FLAGS: tl.constexpr, Q_AXIS: tl.constexpr, ROW_AXIS: tl.constexpr):
    # The cand selection (topk_softmax's docstring) with the 8 levels = the (at most 8) groups: group scores are
    # per-level integer reductions, the kept groups come from a sort of 8 coarse group keys (verified like the
    # experts), then the experts as in topk_softmax's cand kernel; any failed row: grouped_rows for the program.
    NONE: tl.constexpr = 8 * LANES
    CA: tl.constexpr = 1 - ROW_AXIS
    rows, in_range, live = program_rows(pad_ptr, num_tokens, BLOCK_T, HAS_PAD)
    base2 = tl.expand_dims(logits_ptr + rows.to(tl.int64) * stride_logits, CA)
    live2 = tl.expand_dims(live, CA)
    slot = tl.expand_dims(tl.arange(0, LANES), ROW_AXIS) + 0 * tl.expand_dims(rows, CA)
    x0, x1 = level_logits(base2, live2, slot, 0, G, GS), level_logits(base2, live2, slot, 1, G, GS)
    x2, x3 = level_logits(base2, live2, slot, 2, G, GS), level_logits(base2, live2, slot, 3, G, GS)
    x4, x5 = level_logits(base2, live2, slot, 4, G, GS), level_logits(base2, live2, slot, 5, G, GS)
    x6, x7 = level_logits(base2, live2, slot, 6, G, GS), level_logits(base2, live2, slot, 7, G, GS)
    rm2 = tl.expand_dims(tl.zeros([BLOCK_T], tl.float32), CA)
    inv2 = rm2 + 1.0
    if not SIGMOID:
        rm2 = row_max_8(x0, x1, x2, x3, x4, x5, x6, x7, CA)
        inv2 = tl.expand_dims(1.0 / row_sum_8(tl.exp(x0 - rm2), tl.exp(x1 - rm2), tl.exp(x2 - rm2),
                                              tl.exp(x3 - rm2), tl.exp(x4 - rm2), tl.exp(x5 - rm2),
                                              tl.exp(x6 - rm2), tl.exp(x7 - rm2), CA), CA)
    b0, n0, v0 = group_level(x0, slot, rm2, inv2, bias_ptr, 0, G, GS, SIGMOID, HAS_BIAS)
    b1, n1, v1 = group_level(x1, slot, rm2, inv2, bias_ptr, 1, G, GS, SIGMOID, HAS_BIAS)
    b2, n2, v2 = group_level(x2, slot, rm2, inv2, bias_ptr, 2, G, GS, SIGMOID, HAS_BIAS)
    b3, n3, v3 = group_level(x3, slot, rm2, inv2, bias_ptr, 3, G, GS, SIGMOID, HAS_BIAS)
    b4, n4, v4 = group_level(x4, slot, rm2, inv2, bias_ptr, 4, G, GS, SIGMOID, HAS_BIAS)
    b5, n5, v5 = group_level(x5, slot, rm2, inv2, bias_ptr, 5, G, GS, SIGMOID, HAS_BIAS)
    b6, n6, v6 = group_level(x6, slot, rm2, inv2, bias_ptr, 6, G, GS, SIGMOID, HAS_BIAS)
    b7, n7, v7 = group_level(x7, slot, rm2, inv2, bias_ptr, 7, G, GS, SIGMOID, HAS_BIAS)
    # group scores and the kept groups: coarse group keys, sorted; kept = at or above the TOPK_GROUP-th
    g0 = group_coarse(group_score_key(tl.where(v0, orderable_key(b0), INT32_MIN), HAS_BIAS, CA), 0, G)
    g1 = group_coarse(group_score_key(tl.where(v1, orderable_key(b1), INT32_MIN), HAS_BIAS, CA), 1, G)
    g2 = group_coarse(group_score_key(tl.where(v2, orderable_key(b2), INT32_MIN), HAS_BIAS, CA), 2, G)
    g3 = group_coarse(group_score_key(tl.where(v3, orderable_key(b3), INT32_MIN), HAS_BIAS, CA), 3, G)
    g4 = group_coarse(group_score_key(tl.where(v4, orderable_key(b4), INT32_MIN), HAS_BIAS, CA), 4, G)
    g5 = group_coarse(group_score_key(tl.where(v5, orderable_key(b5), INT32_MIN), HAS_BIAS, CA), 5, G)
    g6 = group_coarse(group_score_key(tl.where(v6, orderable_key(b6), INT32_MIN), HAS_BIAS, CA), 6, G)
    g7 = group_coarse(group_score_key(tl.where(v7, orderable_key(b7), INT32_MIN), HAS_BIAS, CA), 7, G)
    r0, r1, r2, r3, r4, r5, r6, r7 = sort8_desc(g0, g1, g2, g3, g4, g5, g6, g7)
    last_kept = nth_of_8(r0, r1, r2, r3, r4, r5, r6, r7, TOPK_GROUP - 1)
    if TOPK_GROUP < G:
        # the kept set is exact when the last kept group truncates strictly above the best dropped one
        group_fail = (last_kept >> 3) == (nth_of_8(r0, r1, r2, r3, r4, r5, r6, r7, TOPK_GROUP) >> 3)
    else:
        group_fail = rows < 0
    kept_bits = ((g0 >= last_kept).to(tl.int32) | ((g1 >= last_kept).to(tl.int32) << 1)
                 | ((g2 >= last_kept).to(tl.int32) << 2) | ((g3 >= last_kept).to(tl.int32) << 3)
                 | ((g4 >= last_kept).to(tl.int32) << 4) | ((g5 >= last_kept).to(tl.int32) << 5)
                 | ((g6 >= last_kept).to(tl.int32) << 6) | ((g7 >= last_kept).to(tl.int32) << 7))
    s0, s1, s2, s3, s4, s5, s6, s7 = sort8_desc(
        masked_level_key(b0, n0, v0, g0 >= last_kept, B, CA), masked_level_key(b1, n1, v1, g1 >= last_kept, B, CA),
        masked_level_key(b2, n2, v2, g2 >= last_kept, B, CA), masked_level_key(b3, n3, v3, g3 >= last_kept, B, CA),
        masked_level_key(b4, n4, v4, g4 >= last_kept, B, CA), masked_level_key(b5, n5, v5, g5 >= last_kept, B, CA),
        masked_level_key(b6, n6, v6, g6 >= last_kept, B, CA), masked_level_key(b7, n7, v7, g7 >= last_kept, B, CA))
    cids, t_k, t_c = pick_candidates(s0, s1, s2, s3, s4, s5, s6, s7, slot, K, C, B, NONE, CA)
    if C < G * GS:
        expert_fail = t_c == t_k
    else:
        expert_fail = rows < 0
    fallback = tl.max((live & (group_fail | expert_fail)).to(tl.int32), 0)
    if HAS_FLAGS:
        tl.store(flags_ptr + tl.program_id(0), fallback)
    if fallback == 0:
        is_cand = slot < C
        xg = tl.load(base2 + cids, mask=live2 & is_cand, other=0.0).to(tl.float32)
        bg = add_bias(activate(xg, rm2, inv2, SIGMOID), bias_ptr, cids, is_cand, HAS_BIAS)
        kept = ((tl.expand_dims(kept_bits, CA) >> (cids // GS)) & 1) != 0
        bg = tl.where(kept, bg, float("-inf"))
        ids = exact_pick_2d(tl.where(is_cand, orderable_key(bg), INT32_MIN), cids, slot, K, NONE, CA)
        xw = tl.load(base2 + ids, mask=live2 & (slot < K), other=0.0).to(tl.float32)
        store_rows_2d(ids_ptr, weights_ptr, ids, activate(xw, rm2, inv2, SIGMOID), slot, rows, in_range, live, K,
                      RENORMALIZE, routed_scaling_factor, CA)
    else:
        grouped_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, rows, in_range, live, stride_logits,
                     routed_scaling_factor, G, GS, G_PAD, GS_PAD, TOPK_GROUP, K, K_PAD, BLOCK_T, SIGMOID,
                     HAS_BIAS, RENORMALIZE, Q_AXIS, False)


def grouped_topk(logits: torch.Tensor, top_k: int, num_expert_group: int, topk_group: int, scoring: str = "softmax",
                 bias: torch.Tensor | None = None, renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 is_padding: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 config: str | None = None, fallback_flags: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton grouped router: (weights fp32 [T, K], ids int32 [T, K]); see the module docstring.

    config: as topk_softmax's (router_common.RouterConfig; None: grouped_choice); outputs do not depend on it. A
    cand selection applies to 2..8 groups (its levels are the groups); other group counts run the two-pass kernel.
    fallback_flags: as topk_softmax's (grouped_cand_programs entries; left as they are when the two-pass kernel
    runs)."""
    num_tokens, num_experts = check_grouped_args(logits, top_k, num_expert_group, topk_group, scoring, bias,
                                                  is_padding)
    logits, bias, weights, ids = triton_router_operands(logits, top_k, num_experts, is_padding, bias, out)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // num_expert_group
    g_pad, gs_pad = next_pow2(num_expert_group), next_pow2(group_size)
    cfg = grouped_choice(num_tokens, num_experts, top_k, num_expert_group, logits.device, config).config
    if cfg.extra_candidates is not None and cand_shape_ok(num_expert_group):
        launch_grouped_cand(logits, bias, is_padding, weights, ids, top_k, num_expert_group, topk_group, scoring,
                            renormalize, routed_scaling_factor, cfg, fallback_flags)
        return weights, ids
    block_t, num_warps = cfg.launch(g_pad * gs_pad)
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


def cand_shape_ok(num_expert_group: int) -> bool:
    """Whether the cand kernel takes this grouping: its 8 levels are the groups (one group: nothing to gain)."""
    return 2 <= num_expert_group <= 8


def grouped_cand_geometry(num_experts: int, num_expert_group: int, top_k: int, extra: int):
    """(C, LANES, B) of the grouped cand kernel."""
    num_candidates = min(top_k + extra, num_experts)
    lanes, _ = cand_geometry(8 * next_pow2(num_experts // num_expert_group), num_candidates)
    return num_candidates, lanes, max(0, (next_pow2(num_experts) - 1).bit_length())


def grouped_cand_programs(num_tokens: int, num_experts: int, num_expert_group: int, top_k: int,
                          config: str | None = None, device=None) -> int:
    """Programs a grouped cand launch runs (the length fallback_flags needs)."""
    cfg = grouped_choice(num_tokens, num_experts, top_k, num_expert_group, device, config).config
    _, lanes, _ = grouped_cand_geometry(num_experts, num_expert_group, top_k, cfg.extra_candidates or 0)
    return triton.cdiv(num_tokens, cfg.launch(8 * lanes)[0])


def launch_grouped_cand(logits, bias, is_padding, weights, ids, top_k, num_expert_group, topk_group, scoring,
                        renormalize, routed_scaling_factor, cfg, fallback_flags) -> None:
    num_tokens, num_experts = logits.shape
    group_size = num_experts // num_expert_group
    num_candidates, lanes, id_bits = grouped_cand_geometry(num_experts, num_expert_group, top_k,
                                                           cfg.extra_candidates)
    block_t, num_warps = cfg.launch(8 * lanes)
    grid = (triton.cdiv(num_tokens, block_t),)
    if fallback_flags is not None and (fallback_flags.dtype != torch.int32 or fallback_flags.numel() < grid[0]):
        raise ValueError(f"fallback_flags must be an int32 tensor of >= {grid[0]} entries")
    _grouped_topk_cand_kernel[grid](
        logits, bias if bias is not None else logits,
        is_padding.view(torch.uint8) if is_padding is not None else logits,
        weights, ids, fallback_flags if fallback_flags is not None else ids, num_tokens, logits.stride(0),
        float(routed_scaling_factor), G=num_expert_group, GS=group_size, G_PAD=next_pow2(num_expert_group),
        GS_PAD=next_pow2(group_size), TOPK_GROUP=topk_group, K=top_k, K_PAD=next_pow2(top_k), C=num_candidates,
        LANES=lanes, B=id_bits, BLOCK_T=block_t, SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None,
        HAS_PAD=is_padding is not None, RENORMALIZE=bool(renormalize), HAS_FLAGS=fallback_flags is not None,
        Q_AXIS=Q_AXIS, ROW_AXIS=router_cand.ROW_AXIS, num_warps=num_warps)
