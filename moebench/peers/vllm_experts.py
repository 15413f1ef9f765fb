"""vLLM's fused_experts (its Triton fused MoE) as experts peers (library "vllm", the Library of peers.vllm):

  fused_experts.vllm      fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, ...): bf16, silu
  fused_experts.fp8_vllm  the same on fp8 w8a8 block-scaled weights (block_shape [128, 128]): use_fp8_w8a8=True,
                          w1_scale, w2_scale, block_shape, or quant_config=fp8_w8a8_moe_quant_config(...) in the
                          versions whose fused_experts takes a quant_config instead

Sources read (vllm-project/vllm): model_executor/layers/fused_moe/fused_moe.py at 000d1458 (fused_experts' keywords,
get_config_file_name, get_moe_configs, try_get_optimal_moe_config, get_default_config, the kernel's expert -1
blocks), the later try_get_optimal_moe_config signatures (without is_marlin; with E), config.py's
fp8_w8a8_moe_quant_config, and the alignment kernels of peers.vllm.

Skipped routes: fused_experts aligns topk_ids with moe_align_block_size, which reads no -1 id (peers.vllm); vLLM's
own EP path skips routes through fused_experts' expert_map. So the adapter hands a skipped route as id E through an
(E + 1)-entry identity expert_map whose last entry is -1, with global_num_experts = E + 1 (the map made once on the
first, untimed call; the torch.where that replaces -1 by E is timed): both alignment kernels then leave it in an
expert -1 block, whose GEMM tiles write zeros (info "vllm_skipped_routes"). Versions that apply the map after the
alignment in Python (expert_ids = expert_map[expert_ids]) see the same: id E is a bucket of their E + 1. (Later
versions' alignment also takes ignore_invalid_experts for -1 ids; the map works in every version read.)

Launch config: fused_experts picks its own (try_get_optimal_moe_config: vLLM's tuned file
configs/E=<E>,N=<I>,device_name=<GPU>[,dtype=fp8_w8a8][,block_shape=[128,128]].json, the entry of the batch size
closest to the rows of a chunk, min(T, VLLM_FUSED_MOE_CHUNK_SIZE); without a file for this GPU and shape,
get_default_config). The adapter asks the same functions the same question on the build (untimed) and records the
answer: info "vllm_config_file", "vllm_config_source" (vLLM's tuned file, or its default rule) and "vllm_config".
A vLLM whose fused_experts takes no expert_map cannot be handed skipped routes: the first (untimed) call refuses
such a point, and runs one without them.

fp8: vLLM takes the bf16 hidden states and quantises them itself (per_token_group_quant_fp8, group 128, fp32
scales: timed, as vLLM runs); the weights are moebench's e4m3 128x128 blocks with fp32 block scales (vLLM's layout
for block_shape [128, 128]). The check judges the operands vLLM multiplies: its own quantisation of the same rows
(per_token_group_quant_fp8, or its recipe in torch where the library has none), its bf16 gate/up output and its bf16
SwiGLU output before the 1x128 re-quantisation (h_store_rel = 2 x 2^-8 bounds both roundings: the SwiGLU's
sensitivity to h is at least |a| per unit of relative error). Its result is a new tensor, copied into out (timed).

None of this has run against a real vLLM: tests/standins/vllm_ops.py stands in with these call signatures and the
behaviour read from the sources above.
"""

from __future__ import annotations

import torch

from moebench.bench.experts_fp8 import Fp8Inputs, Fp8Operands, build_fp8_outside, fp8_layout_problem
from moebench.kernels.fp8_quant import ACT_GROUP, WEIGHT_BLOCK, dequantize_weights, requantize_rows_fp8_torch
from moebench.kernels.fused_experts_fp8_ref import BF16_REL
from moebench.peers._lib import accepts, register_adapter
from moebench.peers.vllm import VLLM
from moebench.registry import register_impl

__all__ = ["skip_map", "picked_config", "make_fused_experts", "make_fp8_vllm", "BLOCK_SHAPE"]

BLOCK_SHAPE = [WEIGHT_BLOCK, WEIGHT_BLOCK]  # vLLM's block-quantised fp8: 128x128 weight blocks, 1x128 activations
SKIPPED = ("as id E through an (E + 1)-entry identity expert_map whose last entry is -1 (vLLM's alignment reads no "
           "-1 id); the -1 -> E replacement is timed")
SOURCE = "written from vLLM's fused_moe sources"
NO_MAP = "none: this vLLM's fused_experts takes no expert_map (a point with skipped routes is refused)"


def skip_map(num_experts: int, device) -> torch.Tensor:
    """int32 [E + 1]: the identity on [0, E) and -1 for id E, the id skipped routes are handed as."""
    return torch.cat([torch.arange(num_experts, dtype=torch.int32, device=device),
                      torch.full((1,), -1, dtype=torch.int32, device=device)])


def picked_config(lib, w1_shape, w2_shape, top_k: int, dtype: str | None, tokens: int, block_shape=None) -> dict:
    """What vLLM's fused_experts runs with at this shape, asked of its own lookup: {vllm_config_file,
    vllm_config_source, vllm_config}, or the reason it could not be asked. vLLM looks up the rows of a chunk."""
    M = min(tokens, int(getattr(lib, "VLLM_FUSED_MOE_CHUNK_SIZE", tokens)))
    names = ("try_get_optimal_moe_config", "get_config_file_name", "get_moe_configs")
    if not all(hasattr(lib, n) for n in names):
        missing = " / ".join(n for n in names if not hasattr(lib, n))
        return {"vllm_config_source": f"unknown: this vLLM has no {missing}"}
    E, _, N = w2_shape
    block_n, block_k = block_shape if block_shape else (0, 0)
    lookup = lib.try_get_optimal_moe_config
    args = dict(w1_shape=tuple(w1_shape), w2_shape=tuple(w2_shape), top_k=top_k, dtype=dtype, M=M, E=E,
                block_shape=block_shape, is_marlin=False)
    try:
        file = lib.get_config_file_name(E, N, dtype, block_shape)
        tuned = lib.get_moe_configs(E, N, dtype, block_n, block_k) is not None
        config = lookup(**{k: v for k, v in args.items() if accepts(lookup, k)})
    except Exception as e:  # a signature this adapter does not know: said in the record, the point still runs
        return {"vllm_config_source": f"unknown: vLLM's lookup failed ({type(e).__name__}: {str(e)[:160]})"}
    if isinstance(config, tuple):  # versions that can also return whether the config is an embedded one
        config = config[0]
    source = (f"vLLM's tuned file {file}" if tuned else
              f"vLLM's default rule (get_default_config): vLLM ships no {file}")
    return {"vllm_config_file": file, "vllm_config_source": source, "vllm_config": dict(config)}


class _SkippedRoutes:
    """topk_ids -> the keywords that hand them to fused_experts: ids with -1 replaced by E, global_num_experts E + 1
    and the (E + 1)-entry map (made on first use); for a vLLM without expert_map, the ids as they are, refused on the
    first (untimed) call when they hold a skipped route."""

    def __init__(self, op):
        self.takes_map = accepts(op, "expert_map")
        self.maps: dict = {}

    def __call__(self, topk_ids: torch.Tensor, num_experts: int) -> dict:
        key = (num_experts, topk_ids.device)
        if key not in self.maps:
            if not self.takes_map and bool((topk_ids < 0).any()):
                raise ValueError("this vLLM's fused_experts takes no expert_map: skipped routes (-1) cannot be handed "
                                 "to it (its alignment reads no -1 id)")
            self.maps[key] = skip_map(num_experts, topk_ids.device) if self.takes_map else None
        if not self.takes_map:
            return {"topk_ids": topk_ids}
        ids = torch.where(topk_ids < 0, torch.full_like(topk_ids, num_experts), topk_ids)
        return {"topk_ids": ids, "global_num_experts": num_experts + 1, "expert_map": self.maps[key]}


def make_fused_experts(lib):
    op = lib.fused_experts
    extra = {k: v for k, v in (("inplace", False), ("activation", "silu"), ("allow_deep_gemm", False))
             if accepts(op, k)}
    skipped = _SkippedRoutes(op)

    def fn(x, w13, w2, topk_weights, topk_ids, *, out=None):
        if "vllm_config_source" not in fn.info:  # the first, untimed call
            fn.info.update(picked_config(lib, w13.shape, w2.shape, topk_ids.shape[1], None, x.shape[0]))
        return op(x, w13, w2, topk_weights, **skipped(topk_ids, w13.shape[0]), **extra)
    fn.info = {"adapter_source": SOURCE, "vllm_skipped_routes": SKIPPED if skipped.takes_map else NO_MAP}
    return fn


def vllm_group_quant(lib, rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token-group fp8 quantisation of bf16 rows: its own function where this vLLM exports it, else
    the recipe (scale = amax / 448 per group of `group` columns) in torch."""
    if hasattr(lib, "per_token_group_quant_fp8"):
        q, s = lib.per_token_group_quant_fp8(rows, group)
        return q, s.float()
    return requantize_rows_fp8_torch(rows, group)


def make_fp8_vllm(lib):
    """The fp8 family's outside make(p, inputs) -> (fn, operands) around vLLM's fused_experts."""
    op = lib.fused_experts
    takes_quant_config = accepts(op, "quant_config") and not accepts(op, "use_fp8_w8a8")
    extra = {k: v for k, v in (("inplace", False), ("activation", "silu"), ("allow_deep_gemm", False))
             if accepts(op, k)}

    def make(p, inp: Fp8Inputs):
        hidden = inp.batch.hidden
        E = inp.w13_q.shape[0]
        if takes_quant_config:
            quant = {"quant_config": lib.fp8_w8a8_moe_quant_config(w1_scale=inp.w13_s, w2_scale=inp.w2_s,
                                                                   block_shape=BLOCK_SHAPE)}
        else:
            quant = {"use_fp8_w8a8": True, "w1_scale": inp.w13_s, "w2_scale": inp.w2_s, "block_shape": BLOCK_SHAPE}
        skipped = _SkippedRoutes(op)

        def fn(topk_ids, topk_weights, *, out):
            out.copy_(op(hidden, inp.w13_q, inp.w2_q, topk_weights, **skipped(topk_ids, E), **quant, **extra))
            return out
        fn.info = {"adapter_status": VLLM.status(), "adapter_source": SOURCE,
                   "vllm_skipped_routes": SKIPPED if skipped.takes_map else NO_MAP,
                   "vllm_fp8_input": "bf16 rows, quantised by vLLM (timed)",
                   "vllm_fp8_api": "quant_config" if takes_quant_config else "use_fp8_w8a8 keywords",
                   **picked_config(lib, inp.w13_q.shape, inp.w2_q.shape, inp.ids.shape[1], "fp8_w8a8",
                                   hidden.shape[0], BLOCK_SHAPE)}
        x_q, x_s = vllm_group_quant(lib, hidden, BLOCK_SHAPE[1])
        rows, cols = x_q.shape
        x = (x_q.float().reshape(rows, cols // BLOCK_SHAPE[1], BLOCK_SHAPE[1]) * x_s[:, :, None]).reshape(rows, cols)
        operands = Fp8Operands(x, lambda e: dequantize_weights(inp.w13_q[e], inp.w13_s[e]),
                               lambda e: dequantize_weights(inp.w2_q[e], inp.w2_s[e]), act_group=ACT_GROUP,
                               h_store_rel=2 * BF16_REL)
        return fn, operands
    return make


register_adapter(VLLM, "fused_experts", "vllm", "fused_experts", make_fused_experts,
                 "vLLM fused_experts (its Triton fused MoE), bf16 silu, vLLM's launch config for the shape (its "
                 "tuned file or default, recorded); skipped routes through an expert_map entry of -1")
register_impl("fused_experts.fp8_vllm", targets=("kernel",), validate=fp8_layout_problem, library=VLLM.name,
              available=lambda ctx: VLLM.available(ctx, "fused_experts"),
              description="vLLM fused_experts fp8 w8a8 block [128, 128] (its Triton fused MoE): quantises the bf16 "
                          "rows itself, vLLM's launch config (recorded); skipped routes through an expert_map -1"
              )(lambda p, ctx: build_fp8_outside(make_fp8_vllm(VLLM.get()))(p, ctx))
