"""Stand-in for SGLang's `sgl_kernel` (topk_softmax, moe_fused_gate, moe_align_block_size), with the signatures of
sgl-kernel/python/sgl_kernel/moe.py at sgl-project/sglang 0c1e18c1 and the alignment's -1 bucket of
sgl-kernel/csrc/moe/moe_align_kernel.cu (ids counted at id + 1, unchecked)."""

import torch

from ._common import align_segments, grouped_select

MOEBENCH_STANDIN = "sglang"  # the moebench.peers Library it stands in for


def topk_softmax(topk_weights, topk_ids, gating_output, renormalize=False):
    probs = torch.softmax(gating_output.float(), dim=-1)
    w, i = probs.topk(topk_ids.shape[1], dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    topk_weights.copy_(w)
    topk_ids.copy_(i)


def moe_fused_gate(input_tensor, bias, num_expert_group, topk_group, topk, num_fused_shared_experts=0,
                   routed_scaling_factor=0, apply_routed_scaling_factor_on_output=False):
    s = torch.sigmoid(input_tensor.float())
    w, ids = grouped_select(s + bias.float(), s, num_expert_group, topk_group, topk)
    w = w / w.sum(dim=-1, keepdim=True)
    if apply_routed_scaling_factor_on_output:
        w = w * routed_scaling_factor
    return w, ids.to(torch.int32)


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         cumsum_buffer, pad_sorted_token_ids=False):
    # SGLang's convention: num_experts counts one extra bucket (0) for the skipped (-1) routes, emitted as expert -1.
    # Its kernels count at shared_counts[id + 1] with no range check: any other id is an out-of-bounds atomic.
    flat = topk_ids.reshape(-1)
    if bool(((flat < -1) | (flat >= num_experts - 1)).any()):
        raise IndexError(f"moe_align_block_size: ids must lie in [-1, {num_experts - 1}) (counted at id + 1 with no "
                         "range check: an out-of-bounds atomic on the GPU)")
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(flat.numel())
    buckets, padded = align_segments(flat, num_experts, block_size,
                                     lambda e: e + 1 if -1 <= e < num_experts - 1 else None)
    pos = 0
    for b, routes in enumerate(buckets):
        sorted_token_ids[pos:pos + len(routes)] = torch.tensor(routes, dtype=torch.int32)
        experts_ids[pos // block_size:(pos + padded[b]) // block_size] = b - 1
        pos += padded[b]
    num_tokens_post_pad.fill_(pos)
