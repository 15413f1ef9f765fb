"""topk_softmax: the softmax top-k router (docs/contracts.md "Routers"), Triton kernel beside its eager-torch reference.

p = softmax(logits) in fp32; selection ranks p + bias (bias optional, fp32 [E]); the stored weight is the unbiased
p; ties go to the lower expert index; slots are in descending selection score; `renormalize` divides by the sum of
the K weights (left as is when that sum is 0); padded rows get ids -1 and weights 0.0.

The Triton kernel handles a block of rows per program with the expert axis padded to a power of two (masked). The
picks work on an int32 image of the fp32 score whose signed order is the float order (equal floats <=> equal keys,
so the tie rule is exact); non-finite scores are clamped to 0 first (docs/contracts.md "Routers"). The weights are
recomputed from the K gathered logits, so no full-width value is carried through the picks.

Selections (router_common.RouterConfig: the `config` keyword, else the tuned table, else the rule, softmax_choice;
ids and weights are the same under all, and the tests run every config):
- "twopass": per pick, an int32 max of the keys, an int32 min of the expert ids holding it (one REDUX each on
  sm_80+), then a knock-out by id. K scans of the whole row, so it is bound by instruction issue at large T.
- "packed64": one max per pick over int64 keys `score key << 32 | (NONE - expert)`; sm_90 has no 64-bit REDUX, so
  each step costs about twice the two-pass's instructions. A tuning candidate only.
- "cand<M>" (kernels/_details/router_cand): each score becomes a coarse int32 key, its low B bits (B = bits of the
  padded expert count) replaced by 2^B - 1 - expert, so keys are distinct and order by (truncated score, lower id).
  Each column of the [levels, BLOCK_T, LANES] row is sorted once by a comparator network; a pick is then one max
  over the column heads and a shift of the winning column. C = K + M candidates are picked, their exact scores
  recomputed with the tile's own op sequence, and the K results chosen by the exact two-pass pick on that small
  tile: a few int32 ops per element instead of the two-pass's 6 per pick.

  Exactness: the K-th exact pick has the K-th largest truncated score among the candidates, so when
  trunc(C-th pick) < trunc(K-th pick) no other expert can reach it. A program with any live row failing that test
  runs the full two-pass selection instead (the fallback_flags argument exposes the flag), so results are always
  exact; it fails when M + 1 or more scores from the K-th pick on share its truncated value (ties of equal bf16
  logits; rows of a constant, NaN / +Inf rows), never on padded rows.

How fast each selection is, and why: docs/benchmarks.md#routers. The pieces shared with grouped_topk (argument
checks, the stable selection of the references, the tile helpers) are in kernels/_details (router_common,
router_tiles).
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
    cand_level,
    coarse_key,
    exact_pick_2d,
    pick_candidates,
    row_max_8,
    row_sum_8,
    sort8_desc,
    store_rows_2d,
)
from moebench.kernels._details.router_common import (  # noqa: F401  (MAX_EXPERTS, MAX_TOP_K: part of the API)
    MAX_EXPERTS,
    MAX_TOP_K,
    check_router_args,
    mask_padded_rows_torch,
    register_router_tunable,
    renormalize_torch,
    router_choice,
    router_limits_problem,
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

__all__ = ["topk_softmax", "topk_softmax_torch", "topk_softmax_scores_torch", "MAX_EXPERTS", "MAX_TOP_K",
           "router_limits_problem", "router_outputs", "softmax_choice"]

register_router_tunable("topk_softmax", lambda num_tokens, num_experts, top_k:
                        f"T={pow2_bucket(num_tokens)},E={num_experts},K={top_k}")


def softmax_choice(num_tokens: int, num_experts: int, top_k: int, device=None, config=None) -> Choice:
    """topk_softmax's launch config at [num_tokens, num_experts], top_k on `device`: `config`, else the tuned
    table (bucket T=next_pow2(tokens),E,K), else the rule (router_common.DEFAULT_ROUTER_CONFIG)."""
    return router_choice("topk_softmax", device, config, num_tokens=num_tokens, num_experts=num_experts,
                         top_k=top_k)


# ---------------------------------------------------------------------------------------------------------------
# Reference (eager torch, docs/contracts.md literally)
# ---------------------------------------------------------------------------------------------------------------

def topk_softmax_scores_torch(logits: torch.Tensor, bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, selection score): p = softmax(logits) in fp32 with non-finite p clamped to 0, selection = p + bias (or
    p)."""
    probs = zero_non_finite_torch(torch.softmax(logits.float(), dim=-1))
    return probs, (probs + bias.float() if bias is not None else probs)


def topk_softmax_torch(logits: torch.Tensor, top_k: int, renormalize: bool, is_padding: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference softmax top-k router: (weights fp32 [T, K], ids int32 [T, K])."""
    num_tokens, _ = check_router_args(logits, top_k, is_padding, bias)
    if out is not None:
        router_outputs(num_tokens, top_k, logits.device, out)
    probs, selection = topk_softmax_scores_torch(logits, bias)
    ids = select_desc_torch(selection, top_k)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = renormalize_torch(weights)
    ids = ids.to(torch.int32)
    mask_padded_rows_torch(weights, ids, is_padding)
    return write_out(weights, ids, out)




# ---------------------------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def score_topk(ptrs, live3, cols, row_base, live, rows, bias_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
               K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, Q_AXIS: tl.constexpr,
               PACKED: tl.constexpr):
    """ids ranked by the fp32 score p (+ bias), and the unbiased p at them, as slot tiles."""
    if E == E_PAD:  # no column mask at all, so the loads stay 16-byte vectors
        x = tl.load(ptrs, mask=live3, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=live3 & (cols < E), other=0.0).to(tl.float32)
        x = tl.where(cols < E, x, float("-inf"))
    # softmax in fp32 (rows that are not live hold zeros: harmless, their outputs are overwritten)
    row_max = row_reduce_max(x, Q_AXIS)
    e = tl.exp(x - rows_to_tile(row_max, Q_AXIS))
    inv_sum = 1.0 / row_reduce_sum(e, Q_AXIS)
    # a NaN or +Inf logit (or a row of -Inf) makes the row's p NaN: clamped to 0, as the reference does
    score = zero_non_finite(e * rows_to_tile(inv_sum, Q_AXIS))
    if HAS_BIAS:
        # loaded at the tile's full shape (each row re-reads the L1-resident bias) so that the load gets the tile's
        # layout; a load of the bias alone gets a layout of its own and drags the whole selection into it
        bias_ptrs = bias_ptr + cols + 0 * rows_to_tile(rows, Q_AXIS)
        if E == E_PAD:
            score = score + tl.load(bias_ptrs).to(tl.float32)
        else:
            score = score + tl.load(bias_ptrs, mask=cols < E, other=0.0).to(tl.float32)
    if E != E_PAD:
        score = tl.where(cols < E, score, float("-inf"))
    ids = pick_topk(orderable_key(score), cols, K, K_PAD, E_PAD, Q_AXIS, PACKED)
    # the unbiased p at the picked ids, recomputed from the gathered logits the same way
    slot_ok = slot_tile(rows.shape[0], K_PAD, Q_AXIS) < K
    xg = tl.load(rows_to_tile(row_base, Q_AXIS) + ids, mask=rows_to_tile(live, Q_AXIS) & slot_ok, other=0.0)
    w = tl.exp(xg.to(tl.float32) - rows_to_tile(row_max, Q_AXIS)) * rows_to_tile(inv_sum, Q_AXIS)
    return ids, zero_non_finite(w)


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(logits_ptr, bias_ptr, pad_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits,
                         E: tl.constexpr, E_PAD: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PAD: tl.constexpr,
                         RENORMALIZE: tl.constexpr, Q_AXIS: tl.constexpr, PACKED: tl.constexpr):
    # Tile: E_PAD // W slices of W experts (expert = q * W + w) by BLOCK_T rows, W at most one warp's worth of
    # 16-byte vectors, so a row never spans two warps (see Q_AXIS).
    NQ: tl.constexpr = E_PAD // W
    rows, in_range, live = program_rows(pad_ptr, num_tokens, BLOCK_T, HAS_PAD)
    row_base = logits_ptr + rows.to(tl.int64) * stride_logits
    cols = slice_index(NQ, Q_AXIS) * W + tl.arange(0, W)[None, None, :]
    ptrs = rows_to_tile(row_base, Q_AXIS) + cols
    live3 = rows_to_tile(live, Q_AXIS)
    ids, w = score_topk(ptrs, live3, cols, row_base, live, rows, bias_ptr, E, E_PAD, K, K_PAD, HAS_BIAS, Q_AXIS,
                        PACKED)
    store_rows(ids_ptr, weights_ptr, ids, w, rows, in_range, live, K, K_PAD, RENORMALIZE, 1.0, Q_AXIS)


@triton.jit
def softmax_level_key(e, inv2, bias_ptr, expert, valid, HAS_BIAS: tl.constexpr, B: tl.constexpr):
    """Coarse key of one level from its exp(x - row max); the same ops as the candidates' exact re-computation."""
    return coarse_key(add_bias(zero_non_finite(e * inv2), bias_ptr, expert, valid, HAS_BIAS), expert, valid, B)


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_cand_kernel(logits_ptr, bias_ptr, pad_ptr, weights_ptr, ids_ptr, flags_ptr, num_tokens,
                              stride_logits, E: tl.constexpr, E_PAD: tl.constexpr, W: tl.constexpr,
                              K: tl.constexpr, K_PAD: tl.constexpr, C: tl.constexpr, LANES: tl.constexpr,
                              B: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_FLAGS: tl.constexpr,
                              Q_AXIS: tl.constexpr, ROW_AXIS: tl.constexpr):
    # The "cand" selection (module docstring): 8 levels of [BLOCK_T, LANES], C coarse picks, exact resolution
    # among the candidates when the verification holds for every row of the program, else today's two-pass.
    MASKED: tl.constexpr = E != 8 * LANES
    NONE: tl.constexpr = 8 * LANES
    CA: tl.constexpr = 1 - ROW_AXIS
    rows, in_range, live = program_rows(pad_ptr, num_tokens, BLOCK_T, HAS_PAD)
    row_base = logits_ptr + rows.to(tl.int64) * stride_logits
    base2 = tl.expand_dims(row_base, CA)
    live2 = tl.expand_dims(live, CA)
    # full shape: one layout for every tile
    slot = tl.expand_dims(tl.arange(0, LANES), ROW_AXIS) + 0 * tl.expand_dims(rows, CA)
    x0, n0, v0 = cand_level(base2, live2, slot, 0, LANES, E, MASKED)
    x1, n1, v1 = cand_level(base2, live2, slot, 1, LANES, E, MASKED)
    x2, n2, v2 = cand_level(base2, live2, slot, 2, LANES, E, MASKED)
    x3, n3, v3 = cand_level(base2, live2, slot, 3, LANES, E, MASKED)
    x4, n4, v4 = cand_level(base2, live2, slot, 4, LANES, E, MASKED)
    x5, n5, v5 = cand_level(base2, live2, slot, 5, LANES, E, MASKED)
    x6, n6, v6 = cand_level(base2, live2, slot, 6, LANES, E, MASKED)
    x7, n7, v7 = cand_level(base2, live2, slot, 7, LANES, E, MASKED)
    rm2 = row_max_8(x0, x1, x2, x3, x4, x5, x6, x7, CA)
    e0, e1, e2, e3 = tl.exp(x0 - rm2), tl.exp(x1 - rm2), tl.exp(x2 - rm2), tl.exp(x3 - rm2)
    e4, e5, e6, e7 = tl.exp(x4 - rm2), tl.exp(x5 - rm2), tl.exp(x6 - rm2), tl.exp(x7 - rm2)
    inv2 = tl.expand_dims(1.0 / row_sum_8(e0, e1, e2, e3, e4, e5, e6, e7, CA), CA)
    s0, s1, s2, s3, s4, s5, s6, s7 = sort8_desc(
        softmax_level_key(e0, inv2, bias_ptr, n0, v0, HAS_BIAS, B),
        softmax_level_key(e1, inv2, bias_ptr, n1, v1, HAS_BIAS, B),
        softmax_level_key(e2, inv2, bias_ptr, n2, v2, HAS_BIAS, B),
        softmax_level_key(e3, inv2, bias_ptr, n3, v3, HAS_BIAS, B),
        softmax_level_key(e4, inv2, bias_ptr, n4, v4, HAS_BIAS, B),
        softmax_level_key(e5, inv2, bias_ptr, n5, v5, HAS_BIAS, B),
        softmax_level_key(e6, inv2, bias_ptr, n6, v6, HAS_BIAS, B),
        softmax_level_key(e7, inv2, bias_ptr, n7, v7, HAS_BIAS, B))
    cids, t_k, t_c = pick_candidates(s0, s1, s2, s3, s4, s5, s6, s7, slot, K, C, B, NONE, CA)
    # exact when every expert outside the candidates truncates below the K-th pick (docstring); with C == E every
    # expert is a candidate
    if C < E:
        fallback = tl.max((live & (t_c == t_k)).to(tl.int32), 0)
    else:
        fallback = tl.max((live & (rows < 0)).to(tl.int32), 0)
    if HAS_FLAGS:
        tl.store(flags_ptr + tl.program_id(0), fallback)
    if fallback == 0:
        # the candidates' exact scores, re-computed from their logits with the tile's ops, then the exact pick
        is_cand = slot < C
        xg = tl.load(base2 + cids, mask=live2 & is_cand, other=0.0).to(tl.float32)
        score = add_bias(zero_non_finite(tl.exp(xg - rm2) * inv2), bias_ptr, cids, is_cand, HAS_BIAS)
        ids = exact_pick_2d(tl.where(is_cand, orderable_key(score), INT32_MIN), cids, slot, K, NONE, CA)
        xw = tl.load(base2 + ids, mask=live2 & (slot < K), other=0.0).to(tl.float32)
        w = zero_non_finite(tl.exp(xw - rm2) * inv2)
        store_rows_2d(ids_ptr, weights_ptr, ids, w, slot, rows, in_range, live, K, RENORMALIZE, 1.0, CA)
    else:
        # today's full-row two-pass selection for the whole program (same tile and picks as the twopass kernel)
        NQ: tl.constexpr = E_PAD // W
        cols = slice_index(NQ, Q_AXIS) * W + tl.arange(0, W)[None, None, :]
        ids3, w3 = score_topk(rows_to_tile(row_base, Q_AXIS) + cols, rows_to_tile(live, Q_AXIS), cols, row_base,
                              live, rows, bias_ptr, E, E_PAD, K, K_PAD, HAS_BIAS, Q_AXIS, False)
        store_rows(ids_ptr, weights_ptr, ids3, w3, rows, in_range, live, K, K_PAD, RENORMALIZE, 1.0, Q_AXIS)


def row_width(e_pad: int, element_size: int) -> int:
    """Experts per row slice W: at most one warp of 16-byte vectors (256 bf16/fp16, 128 fp32)."""
    return min(e_pad, 32 * (16 // element_size))


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, is_padding: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 config: str | None = None, fallback_flags: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton softmax top-k router: (weights fp32 [T, K], ids int32 [T, K]); see the module docstring.

    config: a router config (router_common.ROUTER_CONFIGS name or "<selection>:<elements per program>:<elements
    per thread>"); None (or "auto"): the tuned table, else the rule (softmax_choice). Outputs do not depend on it.
    fallback_flags: diagnostics of the cand selections only: an int32 tensor with one entry per program, set to 1
    where the program's verification failed and it ran the full two-pass selection (see cand_programs)."""
    num_tokens, num_experts = check_router_args(logits, top_k, is_padding, bias)
    logits, bias, weights, ids = triton_router_operands(logits, top_k, num_experts, is_padding, bias, out)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_pow2(num_experts)
    cfg = softmax_choice(num_tokens, num_experts, top_k, logits.device, config).config
    if cfg.extra_candidates is not None:
        launch_cand(logits, bias, is_padding, weights, ids, top_k, renormalize, cfg, fallback_flags)
        return weights, ids
    block_t, num_warps = cfg.launch(e_pad)
    grid = (triton.cdiv(num_tokens, block_t),)
    _topk_softmax_kernel[grid](
        logits, bias if bias is not None else logits,
        is_padding.view(torch.uint8) if is_padding is not None else logits,
        weights, ids, num_tokens, logits.stride(0),
        E=num_experts, E_PAD=e_pad, W=row_width(e_pad, logits.element_size()), K=top_k, K_PAD=next_pow2(top_k),
        BLOCK_T=block_t,
        HAS_BIAS=bias is not None, HAS_PAD=is_padding is not None, RENORMALIZE=bool(renormalize),
        Q_AXIS=Q_AXIS, PACKED=cfg.selection == "packed64", num_warps=num_warps)
    return weights, ids



def cand_programs(num_tokens: int, num_experts: int, top_k: int, config: str | None = None, device=None) -> int:
    """Programs a cand-selection launch runs (the length fallback_flags needs)."""
    cfg = softmax_choice(num_tokens, num_experts, top_k, device, config).config
    lanes, _ = cand_geometry(next_pow2(num_experts), min(top_k + (cfg.extra_candidates or 0), num_experts))
    return triton.cdiv(num_tokens, cfg.launch(8 * lanes)[0])


def launch_cand(logits, bias, is_padding, weights, ids, top_k, renormalize, cfg, fallback_flags) -> None:
    num_tokens, num_experts = logits.shape
    e_pad = next_pow2(num_experts)
    num_candidates = min(top_k + cfg.extra_candidates, num_experts)
    lanes, id_bits = cand_geometry(e_pad, num_candidates)
    block_t, num_warps = cfg.launch(8 * lanes)
    grid = (triton.cdiv(num_tokens, block_t),)
    if fallback_flags is not None and (fallback_flags.dtype != torch.int32 or fallback_flags.numel() < grid[0]):
        raise ValueError(f"fallback_flags must be an int32 tensor of >= {grid[0]} entries")
    _topk_softmax_cand_kernel[grid](
        logits, bias if bias is not None else logits,
        is_padding.view(torch.uint8) if is_padding is not None else logits,
        weights, ids, fallback_flags if fallback_flags is not None else ids, num_tokens, logits.stride(0),
        E=num_experts, E_PAD=e_pad, W=row_width(e_pad, logits.element_size()), K=top_k, K_PAD=next_pow2(top_k),
        C=num_candidates, LANES=lanes, B=id_bits, BLOCK_T=block_t, HAS_BIAS=bias is not None,
        HAS_PAD=is_padding is not None, RENORMALIZE=bool(renormalize), HAS_FLAGS=fallback_flags is not None,
        Q_AXIS=Q_AXIS, ROW_AXIS=router_cand.ROW_AXIS, num_warps=num_warps)
