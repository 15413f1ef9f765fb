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
- fused_experts (model_executor/layers/fused_moe/fused_moe.py at 000d1458, the keywords of that version): aligns
  topk_ids with moe_align_block_size (so the same id rules: no -1, and the expert_map skips routes), picks its launch
  config with try_get_optimal_moe_config (kept in LAST_CONFIG), gate/up in fp32 rounded to bf16, silu_and_mul
  rounded to bf16, down times the top-k weight rounded to bf16 per route, then moe_sum; routes in expert -1 blocks
  contribute zeros. fp8 w8a8 with block_shape: the bf16 rows and the SwiGLU output quantised by
  per_token_group_quant_fp8 (scale = max(amax, 1e-10) / 448 per group, q = x / scale), weights e4m3 with one fp32
  scale per block. The hidden states must be bf16, fp16 or fp32 (vLLM asserts it).
- get_config_file_name / get_moe_configs / try_get_optimal_moe_config / get_default_config: the file name rule and
  the lookup (closest batch size of the tuned file, else the default rule); the tuned files are TUNED_CONFIGS
  (empty: a test adds the file vLLM would ship) and the device name is DEVICE_NAME.
"""

import torch
import torch.nn.functional as F

from ._common import align_segments, grouped_select

DEVICE_NAME = "stand-in CPU"  # current_platform.get_device_name()
TUNED_CONFIGS: dict[str, dict[int, dict]] = {}  # config file name -> {batch size: config}, as vLLM's configs/ holds
LAST_CONFIG: list[dict] = [{}]  # the launch config fused_experts picked last
FP8_MAX = 448.0

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


def get_config_file_name(E, N, dtype, block_shape=None):
    dtype_part = f",dtype={dtype}" if dtype else ""
    block_part = f",block_shape={list(block_shape)}".replace(" ", "") if block_shape and all(block_shape) else ""
    return f"E={E},N={N},device_name={DEVICE_NAME.replace(' ', '_')}{dtype_part}{block_part}.json"


def get_moe_configs(E, N, dtype, block_n=None, block_k=None):
    block_shape = [block_n, block_k] if block_n and block_k else None
    return TUNED_CONFIGS.get(get_config_file_name(E, N, dtype, block_shape))


def get_default_config(M, E, N, K, topk, dtype, is_marlin=False, block_shape=None):
    if dtype == "fp8_w8a8" and block_shape is not None:
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": block_shape[0], "BLOCK_SIZE_K": block_shape[1],
                "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 3}
    if M <= E:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, is_marlin=False, block_shape=None):
    E, _, N = w2_shape
    block_n, block_k = block_shape if block_shape else (0, 0)
    configs = get_moe_configs(E, N, dtype, block_n, block_k)
    if configs:
        return configs[min(configs, key=lambda m: abs(m - M))]
    return get_default_config(M, E, N, w1_shape[2], top_k, dtype, is_marlin, block_shape)


def per_token_group_quant_fp8(x, group_size, eps=1e-10):
    rows, cols = x.shape
    v = x.float().reshape(rows, cols // group_size, group_size)
    scale = v.abs().amax(dim=2).clamp_min(eps) / FP8_MAX
    q = (v / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def _dequant_rows(q, scale):
    rows, cols = q.shape
    return (q.float().reshape(rows, scale.shape[1], -1) * scale[:, :, None]).reshape(rows, cols)


def _dequant_blocks(w, scale, block_shape):
    bn, bk = block_shape
    return w.float() * scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:w.shape[0], :w.shape[1]]


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                  apply_router_weight_on_input=False, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                  use_int4_w4a16=False, per_channel_quant=False, global_num_experts=-1, expert_map=None,
                  w1_scale=None, w2_scale=None, w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None,
                  block_shape=None, allow_deep_gemm=False):
    if hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise AssertionError(f"Unsupported hidden_states dtype {hidden_states.dtype}")
    if activation != "silu" or inplace or apply_router_weight_on_input:
        raise NotImplementedError("stand-in: out-of-place silu with the weight applied after the down GEMM")
    if use_fp8_w8a8 and (block_shape is None or w1_scale is None or w2_scale is None):
        raise NotImplementedError("stand-in: fp8 w8a8 with block scales only")
    M, top_k = topk_ids.shape
    E = w1.shape[0]
    num_experts = E if global_num_experts == -1 else global_num_experts
    dtype = "fp8_w8a8" if use_fp8_w8a8 else None
    LAST_CONFIG[0] = try_get_optimal_moe_config(w1.shape, w2.shape, top_k, dtype, M, block_shape=block_shape)
    block_m = LAST_CONFIG[0]["BLOCK_SIZE_M"]
    routes = topk_ids.numel()
    bufs = (torch.empty(routes + num_experts * (block_m - 1), dtype=torch.int32),
            torch.empty(routes // block_m + num_experts + 1, dtype=torch.int32), torch.empty(1, dtype=torch.int32))
    moe_align_block_size(topk_ids, num_experts, block_m, *bufs, expert_map)  # its id rules, raised as errors here
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    inter = w2.shape[2]
    x = hidden_states
    if use_fp8_w8a8:
        x = _dequant_rows(*per_token_group_quant_fp8(hidden_states, block_shape[1]))
    per_route = torch.zeros(M, top_k, w2.shape[1], dtype=hidden_states.dtype)
    for e in torch.unique(local[local >= 0]).tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        if use_fp8_w8a8:
            g1, g2 = _dequant_blocks(w1[e], w1_scale[e], block_shape), _dequant_blocks(w2[e], w2_scale[e], block_shape)
        else:
            g1, g2 = w1[e].float(), w2[e].float()
        h = (x[tok].float() @ g1.T).to(hidden_states.dtype)  # intermediate_cache1
        act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(hidden_states.dtype)  # silu_and_mul
        a = _dequant_rows(*per_token_group_quant_fp8(act, block_shape[1])) if use_fp8_w8a8 else act.float()
        y = (a @ g2.T) * topk_weights[tok, slot].float()[:, None]
        per_route[tok, slot] = y.to(hidden_states.dtype)  # intermediate_cache3, MUL_ROUTED_WEIGHT
    out = torch.empty(M, w2.shape[1], dtype=hidden_states.dtype)
    moe_sum(per_route, out)
    return out
