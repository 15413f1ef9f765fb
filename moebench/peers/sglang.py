"""SGLang's sgl_kernel as peers (library "sglang"), each checked against moebench's reference before timing.

  topk_softmax.sglang          sgl_kernel.topk_softmax: both signatures, (topk_weights, topk_ids,
                               token_expert_indices, gating_output) and (topk_weights, topk_ids, gating_output
                               [, renormalize]); renormalisation done after the call where the kernel has no such
                               argument, padded rows set to -1 / 0.0 after it (it takes no mask). No bias.
  grouped_topk.sglang          sgl_kernel.moe_fused_gate(input_tensor, bias, num_expert_group, topk_group, topk,
                               num_fused_shared_experts/n_share_experts_fusion=0, routed_scaling_factor, ...):
                               sigmoid + bias + top-2 group scores, renormalised; points with softmax scoring,
                               without bias or without renormalize are refused. The scaling is asked for on the
                               output where the kernel has `apply_routed_scaling_factor_on_output`. Padded rows
                               masked after.
  moe_align_block_size.sglang  sgl_kernel.moe_align_block_size(topk_ids, num_experts + 1, block_size, sorted_ids,
                               expert_ids, num_tokens_post_pad, [token_cnts_buffer,] cumsum_buffer,
                               pad_sorted_token_ids=True), SGLang's own convention: one extra bucket collects the
                               skipped (-1) routes, emitted as blocks of expert -1, so its buffers are sized for
                               num_experts + 1 experts. Judged after moebench.bench.align.canonical_alignment (which
                               drops those blocks and frees the order within an expert's blocks). With a partial
                               expert map the map is applied first (torch, timed).

Sources read (sgl-project/sglang): sgl-kernel/python/sgl_kernel/moe.py at 0c1e18c1 (the signatures above: topk_softmax
takes no bias and no mask, moe_align_block_size takes cumsum_buffer and pad_sorted_token_ids), sgl-kernel/csrc/moe/
moe_align_kernel.cu (older at ce378154: no -1 bucket, a -1 indexes before its counters; newer: every id counted at
id + 1 with no range check, so -1 is the one sentinel and an id >= num_experts is an out-of-bounds atomic). The
adapter therefore hands skipped routes as -1, never num_experts.

None of these has been run against a real sgl_kernel by moebench's tests: they run against
tests/standins/sgl_kernel_standin.py, a stand-in with these call signatures.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moebench.bench.align import align_build_for
from moebench.kernels.apply_expert_map import apply_expert_map_torch
from moebench.kernels.moe_align_block_size import align_capacity
from moebench.peers._lib import Library, accepts, register_adapter, router_after, router_out, scratch_like


def _load():
    import sgl_kernel

    return SimpleNamespace(**{n: getattr(sgl_kernel, n) for n in ("topk_softmax", "moe_fused_gate",
                                                                  "moe_align_block_size") if hasattr(sgl_kernel, n)})


SGLANG = Library("sglang", "sgl_kernel", _load)


def make_topk_softmax(lib):
    op = lib.topk_softmax
    old_api = accepts(op, "token_expert_indices")
    takes_renorm = accepts(op, "renormalize")
    scratch: dict = {}

    def fn(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        if old_api:
            op(weights, ids, scratch_like(scratch, ids), logits)
        elif takes_renorm:
            op(weights, ids, logits, bool(renormalize))
        else:
            op(weights, ids, logits)
        return router_after(weights, ids, is_padding, renormalize=renormalize and not takes_renorm)
    return fn


def make_fused_gate(lib):
    op = lib.moe_fused_gate
    on_output = accepts(op, "apply_routed_scaling_factor_on_output")
    shared = "num_fused_shared_experts" if accepts(op, "num_fused_shared_experts") else "n_share_experts_fusion"

    def fn(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None, renormalize=True,
           routed_scaling_factor=1.0, is_padding=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        kw = {shared: 0, "routed_scaling_factor": float(routed_scaling_factor)}
        if on_output:
            kw["apply_routed_scaling_factor_on_output"] = True
        w, i = op(logits, bias, num_expert_group, topk_group, top_k, **kw)
        if not on_output and routed_scaling_factor != 1.0:
            w = w * routed_scaling_factor
        return router_after(weights, ids, is_padding, new=(w, i))
    return fn


def make_align(lib):
    op = lib.moe_align_block_size
    has_cnts = accepts(op, "token_cnts_buffer")
    buffers: dict = {}

    def fn(topk_ids, num_experts, block_size, expert_map=None, *, out=None, workspace=None):
        ids = topk_ids if expert_map is None else apply_expert_map_torch(topk_ids, expert_map).to(torch.int32)
        key = (topk_ids.numel(), num_experts, block_size, topk_ids.device)
        if key not in buffers:  # sized for num_experts + 1 (the skipped-route bucket); first call is untimed
            capacity, blocks = align_capacity(topk_ids.numel(), num_experts + 1, block_size)
            dev = topk_ids.device
            bufs = [torch.empty(capacity, dtype=torch.int32, device=dev),
                    torch.empty(blocks, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev)]
            if has_cnts:
                bufs.append(torch.empty((num_experts + 2) * (num_experts + 1), dtype=torch.int32, device=dev))
            bufs.append(torch.empty(num_experts + 2, dtype=torch.int32, device=dev))
            buffers[key] = bufs
        bufs = buffers[key]
        op(ids, num_experts + 1, block_size, *bufs, True)
        return bufs[0], bufs[1], bufs[2]
    return fn


def _no_bias(p):
    return "bias: sgl_kernel.topk_softmax is used without a selection bias" if p.bias else None


def _fused_gate_problem(p):
    if p.scoring != "sigmoid" or not p.bias or not p.renormalize:
        return "scoring/bias/renormalize: moe_fused_gate is sigmoid + bias + renormalised routing only"
    if p.num_experts & (p.num_experts - 1) or p.num_experts // p.num_expert_group > 32:
        return "num_experts: moe_fused_gate needs a power of two with at most 32 experts per group"
    return None


register_adapter(SGLANG, "topk_softmax", "sglang", "topk_softmax", make_topk_softmax,
                 "sgl_kernel.topk_softmax (no mask: padded rows set after the call)", validate=_no_bias)
register_adapter(SGLANG, "grouped_topk", "sglang", "moe_fused_gate", make_fused_gate,
                 "sgl_kernel.moe_fused_gate (sigmoid + bias + top-2 group scores); padded rows masked after",
                 validate=_fused_gate_problem)
register_adapter(SGLANG, "moe_align_block_size", "sglang", "moe_align_block_size", make_align,
                 "sgl_kernel.moe_align_block_size (num_experts + 1 buckets, pad_sorted_token_ids), judged in "
                 "moebench's layout (canonical_alignment)", build_for=lambda fn: align_build_for(fn, canonical=True))
