"""vLLM's kernels as peers (library "vllm"), each checked against moebench's reference before it is timed.

  topk_softmax.vllm          ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output
                             [, renormalize][, is_padding]): `is_padding` passed where the installed version takes
                             it; otherwise the padded rows are set to -1 / 0.0 after the call (inside the timed
                             region: that is what a caller of such a version must do). `renormalize` likewise. No
                             selection bias: points with bias are refused.
  grouped_topk.vllm          ops.grouped_topk(scores, num_expert_group, topk_group, topk, renormalize,
                             routed_scaling_factor, bias, scoring_func): the fused noaux_tc kernel, which always
                             scores groups by their top-2 sum with the bias, so points without bias are refused;
                             softmax scoring hands it softmax(logits) with scoring_func=0 (no activation), sigmoid
                             the logits with scoring_func=1. Padded rows masked after the call.
  moe_align_block_size.vllm  ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids,
                             experts_ids, num_tokens_post_pad[, expert_map]); without the expert_map argument the
                             map is applied before (torch, timed). Judged after moebench.bench.align.
                             canonical_alignment (route order within an expert's blocks is free).
  masked_moe_sum.vllm        ops.moe_sum(input, output): adds every slot (no mask), so it is judged like
                             masked_moe_sum.oblivious (against the all-slots sum) and recorded mask_aware=False.
  fused_experts.vllm         vllm...fused_moe.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, ...):
                             its Triton path, bf16, silu, local ids with -1 for skipped routes.

None of these has been run against a real vLLM by moebench's tests: they run against tests/standins/vllm_ops.py,
a stand-in with these call signatures.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moebench.bench._peer_lib import Library, accepts, register_adapter, router_out
from moebench.bench.align import align_build_for
from moebench.bench.moe_sum import oblivious_build_for
from moebench.kernels._details.router_common import mask_padded_rows_torch
from moebench.kernels.apply_expert_map import apply_expert_map_torch


def _load():
    from vllm import _custom_ops as ops

    ns = SimpleNamespace(**{n: getattr(ops, n) for n in ("topk_softmax", "grouped_topk", "moe_align_block_size",
                                                         "moe_sum") if hasattr(ops, n)})
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts

        ns.fused_experts = fused_experts
    except ImportError:
        pass
    return ns


VLLM = Library("vllm", "vllm", _load)


def make_topk_softmax(lib):
    op = lib.topk_softmax
    takes_renorm, takes_pad = accepts(op, "renormalize"), accepts(op, "is_padding")
    scratch: dict = {}

    def fn(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        key = (tuple(ids.shape), ids.device)
        if key not in scratch:  # first call is the untimed check
            scratch[key] = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
        kw = {}
        if takes_renorm:
            kw["renormalize"] = bool(renormalize)
        if takes_pad and is_padding is not None:
            kw["is_padding"] = is_padding
        op(weights, ids, scratch[key], logits, **kw)
        if renormalize and not takes_renorm:
            weights.div_(weights.sum(dim=-1, keepdim=True))
        if not takes_pad:
            mask_padded_rows_torch(weights, ids, is_padding)
        return weights, ids
    return fn


def make_grouped_topk(lib):
    op = lib.grouped_topk

    def fn(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None, renormalize=True,
           routed_scaling_factor=1.0, is_padding=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else logits
        w, i = op(scores, num_expert_group, topk_group, top_k, bool(renormalize), float(routed_scaling_factor),
                  bias, 0 if scoring == "softmax" else 1)
        weights.copy_(w)
        ids.copy_(i)
        mask_padded_rows_torch(weights, ids, is_padding)
        return weights, ids
    return fn


def make_align(lib):
    op = lib.moe_align_block_size
    takes_map = accepts(op, "expert_map")

    def fn(topk_ids, num_experts, block_size, expert_map=None, *, out=None, workspace=None):
        sorted_ids, expert_ids, num_post = out
        ids = topk_ids
        kw = {}
        if expert_map is not None:
            if takes_map:
                kw["expert_map"] = expert_map
            else:
                ids = apply_expert_map_torch(topk_ids, expert_map).to(torch.int32)
        op(ids, num_experts, block_size, sorted_ids, expert_ids, num_post, **kw)
        return sorted_ids, expert_ids, num_post
    return fn


def make_moe_sum(lib):
    op = lib.moe_sum

    def fn(intermediate, out=None):
        op(intermediate, out)
        return out
    return fn


def make_fused_experts(lib):
    op = lib.fused_experts
    extra = {k: v for k, v in (("inplace", False), ("activation", "silu")) if accepts(op, k)}

    def fn(x, w13, w2, topk_weights, topk_ids, *, out=None):
        kw = dict(extra)
        if accepts(op, "global_num_experts"):
            kw["global_num_experts"] = w13.shape[0]
        return op(x, w13, w2, topk_weights, topk_ids, **kw)
    return fn


def _no_bias(p):
    return "bias: vLLM's topk_softmax has no selection bias" if p.bias else None


def _needs_bias(p):
    if not p.bias:
        return "bias: vLLM's fused grouped_topk always scores groups with the bias (noaux_tc); set bias: true"
    return None


register_adapter(VLLM, "topk_softmax", "vllm", "topk_softmax", make_topk_softmax,
                 "vLLM ops.topk_softmax (is_padding where the installed version has it, else masked after)",
                 validate=_no_bias)
register_adapter(VLLM, "grouped_topk", "vllm", "grouped_topk", make_grouped_topk,
                 "vLLM ops.grouped_topk, the fused noaux_tc router (bias required); padded rows masked after",
                 validate=_needs_bias)
register_adapter(VLLM, "moe_align_block_size", "vllm", "moe_align_block_size", make_align,
                 "vLLM ops.moe_align_block_size, judged in moebench's layout (canonical_alignment)",
                 build_for=lambda fn: align_build_for(fn, canonical=True))
register_adapter(VLLM, "masked_moe_sum", "vllm", "moe_sum", make_moe_sum,
                 "vLLM ops.moe_sum: adds every slot (no mask), judged like the oblivious twin",
                 build_for=oblivious_build_for, mask_aware=False)
register_adapter(VLLM, "fused_experts", "vllm", "fused_experts", make_fused_experts,
                 "vLLM fused_experts (its Triton fused MoE), bf16 silu, -1 routes skipped")
