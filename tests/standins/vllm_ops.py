"""Stand-in for vLLM: `vllm._custom_ops` (topk_softmax, grouped_topk, moe_align_block_size, moe_sum) and
`vllm.model_executor.layers.fused_moe.fused_experts`, with their call signatures."""

import torch
import torch.nn.functional as F

from ._common import align_segments, grouped_select

MOEBENCH_STANDIN = True


def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False):
    probs = torch.softmax(gating_output.float(), dim=-1)
    w, i = probs.topk(topk_ids.shape[1], dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    topk_weights.copy_(w)
    topk_ids.copy_(i)
    T = gating_output.shape[0]
    token_expert_indices.copy_(torch.arange(topk_ids.shape[1])[None, :] * T + torch.arange(T)[:, None])


def grouped_topk(scores, num_expert_group, topk_group, topk, renormalize, routed_scaling_factor, bias,
                 scoring_func=0):
    s = torch.sigmoid(scores.float()) if scoring_func == 1 else scores.float()
    w, ids = grouped_select(s + bias.float(), s, num_expert_group, topk_group, topk)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * routed_scaling_factor, ids.to(torch.int32)


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         expert_map=None):
    flat = topk_ids.reshape(-1)
    if expert_map is not None:
        flat = torch.where(flat >= 0, expert_map.long()[flat.long().clamp_min(0)], -1)
    buckets, padded = align_segments(flat, num_experts, block_size,
                                     lambda e: e if 0 <= e < num_experts else None)
    pos = 0
    for e, routes in enumerate(buckets):
        seg = routes + [flat.numel()] * (padded[e] - len(routes))
        sorted_token_ids[pos:pos + len(seg)] = torch.tensor(seg, dtype=torch.int32)
        experts_ids[pos // block_size:(pos + len(seg)) // block_size] = e
        pos += len(seg)
    num_tokens_post_pad.fill_(pos)  # blocks after it are left as they were


def moe_sum(input, output):
    output.copy_(input.float().sum(dim=1))


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                  apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None):
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(hidden_states.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            h = w1[e].float() @ hidden_states[t].float()
            out[t] += topk_weights[t, k] * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out.to(hidden_states.dtype)
