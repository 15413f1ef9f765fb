"""Stand-in for vLLM: `vllm._custom_ops` (topk_softmax, grouped_topk, moe_align_block_size, moe_sum) and
`vllm.model_executor.layers.fused_moe.fused_experts`, with their call signatures and the behaviour of vLLM's CUDA
sources where a caller can trip on it (vllm-project/vllm csrc/moe/moe_align_sum_kernels.cu at 1377b4e0, the same
alignment in csrc/libtorch_stable/moe/moe_align_sum_kernels.cu at 76f957b3):

- moe_align_block_size: routes < 1024 and num_experts <= 64 take the one-block small-batch kernel, which checks no
  id range (an id >= num_experts counts into a neighbour thread's counters, past the shared array for the last
  thread; with an expert_map it reads past the map); larger problems take the two-block kernel, which skips ids
  >= num_experts before the map. With an expert_map, num_experts is the global count, routes mapped to -1 are
  skipped and the blocks carry local ids. A negative id indexes before the counting buffers on either path. Where
  the real kernel reads or writes out of bounds, this stand-in raises instead.
- moe_sum: kernels for top_k 2, 3 and 4 only, adding in the input dtype (every add rounded to bf16); any other
  top_k falls back to torch's sum_out (fp32 accumulation, one rounding).
"""

import torch
import torch.nn.functional as F

from ._common import align_segments, grouped_select

MOEBENCH_STANDIN = "vllm"  # the moebench.peers Library it stands in for

SMALL_BATCH_ROUTES, SMALL_BATCH_EXPERTS = 1024, 64  # below / up to these, vLLM launches its small-batch kernel
MOE_SUM_KERNEL_TOPK = (2, 3, 4)  # top_k with a vLLM moe_sum kernel; the others fall back to torch


def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False,
                 e_score_correction_bias=None):
    probs = torch.softmax(gating_output.float(), dim=-1)
    selection = probs if e_score_correction_bias is None else probs + e_score_correction_bias.float()
    i = selection.topk(topk_ids.shape[1], dim=-1).indices
    w = probs.gather(1, i)  # the bias picks, the unbiased probability is the weight
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
    return w * routed_scaling_factor, ids.to(torch.int32)  # new tensors: it takes no output buffers


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         expert_map=None):
    if (num_experts + 31) // 32 * 32 >= 1024:
        raise RuntimeError("padded_num_experts must be less than 1024")
    flat = topk_ids.reshape(-1).long()
    if bool((flat < 0).any()):
        raise IndexError("moe_align_block_size: a negative expert id indexes before the kernel's counting buffers "
                         "(an out-of-bounds access on the GPU); hand skipped routes as an id it skips")
    small = flat.numel() < SMALL_BATCH_ROUTES and num_experts <= SMALL_BATCH_EXPERTS
    if small:
        limit = expert_map.numel() if expert_map is not None else num_experts
        if bool((flat >= limit).any()):
            raise IndexError(f"moe_align_block_size: the small-batch kernel (routes < {SMALL_BATCH_ROUTES}, experts "
                             f"<= {SMALL_BATCH_EXPERTS}) checks no id range; id >= {limit} "
                             + ("reads past expert_map" if expert_map is not None else
                                "counts into another thread's counters"))
        kept = torch.ones_like(flat, dtype=torch.bool)
    else:
        kept = flat < num_experts  # the two-block kernel skips these before looking at the map
    local = torch.where(kept, flat, -1)
    if expert_map is not None:
        local = torch.where(kept, expert_map.long()[local.clamp_min(0)], -1)
    buckets, padded = align_segments(local, num_experts, block_size, lambda e: e if e >= 0 else None)
    if sum(padded) > sorted_token_ids.numel():
        raise IndexError("moe_align_block_size: sorted_token_ids is too small for the padded routes")
    sorted_token_ids.fill_(flat.numel())
    pos = 0
    for e, routes in enumerate(buckets):
        sorted_token_ids[pos:pos + len(routes)] = torch.tensor(routes, dtype=torch.int32)
        experts_ids[pos // block_size:(pos + padded[e]) // block_size] = e
        pos += padded[e]
    experts_ids[pos // block_size:] = -1  # the blocks after the last expert's: inactive
    num_tokens_post_pad.fill_(pos)


def moe_sum(input, output):
    top_k = input.shape[1]
    if top_k in MOE_SUM_KERNEL_TOPK:  # moe_sum_kernel<scalar_t, TOPK>: the running sum is a scalar_t
        acc = torch.zeros(output.shape, dtype=input.dtype, device=input.device)
        for k in range(top_k):
            acc = (acc.float() + input[:, k].float()).to(input.dtype)
        output.copy_(acc)
    else:  # at::sum_out(output, input, 1)
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
