"""The layer's experts stage with expert_dtype fp8: the fp8 grouped GEMMs on the rows the stage step staged.

The bf16 layer's experts read the bf16 hidden states; with fp8 they read the staging's e4m3 rows and scales (the
rows an EP dispatch would send), so nothing staged is wasted. The alignment is the layer's own align step (built
with this module's block_m), the per-route output y is the layer's, and the layer's reduce sums it: the experts
stage is fused_experts_fp8 without its slot sum (fp8_expert_gemms). Weights: make_expert_weights' seeded weights
in 128x128 fp8 blocks, quantised once per weight key (bench.experts_fp8's cache, shared with the kernel family).
The check is that family's: the dequantised reference with its derived elementwise bound.
"""

from __future__ import annotations

import torch

from moebench.bench.experts_fp8 import check_within_bound, fp8_layout_problem, quantized_expert_weights
from moebench.check import CheckResult, poison
from moebench.kernels.fp8_quant import ACT_GROUP, WEIGHT_BLOCK
from moebench.kernels.fused_experts_fp8 import fp8_expert_gemms, make_fp8_workspace
from moebench.kernels.fused_experts_fp8_ref import error_model, fp8_reference_with_bound

__all__ = ["Fp8LayerExperts", "fp8_experts_work", "fp8_layout_problem"]


class Fp8LayerExperts:
    """fp8 weights, config and workspace of one layer pipeline's experts stage (num_tokens x top_k routes over
    num_local_experts)."""

    def __init__(self, p, num_tokens: int, device: torch.device):
        E, H, I = p.local_experts, p.hidden, p.intermediate
        self.group_size, self.scale_format = p.group_size, p.scale_format
        self.top_k = p.top_k
        self.w13_q, self.w13_scales, self.w2_q, self.w2_scales = quantized_expert_weights(
            E, H, I, seed=p.seed, device=device)
        # tuned table, else rule; fitted to the staged activation scales' layout
        self.workspace = make_fp8_workspace(num_tokens, p.top_k, E, H, I, device=device, group_size=p.group_size,
                                            scale_format=p.scale_format)
        self.config = self.workspace.config
        self.block_m = self.config.block_m
        self.model = error_model(device, H, I)

    @property
    def y(self) -> torch.Tensor:
        """bf16 [T*K, H]: the weighted expert output per route, the layer's reduce input."""
        return self.workspace.y

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.workspace.act, self.workspace.act_scales, self.workspace.y

    def run(self, staged: tuple[torch.Tensor, ...], alignment: tuple[torch.Tensor, ...]) -> None:
        """The gate/up + SwiGLU + re-quantisation and the down + top-k weight GEMMs on the staged rows, placed
        by `alignment` (routes the alignment skips are never computed)."""
        x_q, x_scales, _, topk_weights = staged
        fp8_expert_gemms(x_q, x_scales, topk_weights, self.w13_q, self.w13_scales, self.w2_q, self.w2_scales,
                         self.workspace, alignment, top_k=self.top_k, group_size=self.group_size,
                         scale_format=self.scale_format)

    def check_rows(self, got: torch.Tensor, x_q: torch.Tensor, x_scales: torch.Tensor, topk_weights: torch.Tensor,
                   local_ids: torch.Tensor, rows: torch.Tensor) -> CheckResult:
        """`got` (the layer's out at `rows`) against the dequantised reference of those rows, element by element
        within the derived bound."""
        sel = (lambda t: t.index_select(0, rows))
        ref, bound = fp8_reference_with_bound(sel(x_q), sel(x_scales), sel(local_ids), sel(topk_weights),
                                              self.w13_q, self.w13_scales, self.w2_q, self.w2_scales,
                                              group_size=self.group_size, scale_format=self.scale_format,
                                              model=self.model)
        got = got.float()
        res = check_within_bound("out", got, ref, bound)
        num = torch.linalg.vector_norm((got - ref).double())
        den = torch.linalg.vector_norm(ref.double()).clamp_min(1e-30)
        res.metrics["out.frobenius_rel"] = float(num / den) if bool(torch.isfinite(got).all()) else float("inf")
        return res

    def poison(self) -> None:
        for t in self.buffers():
            poison(t)


def fp8_experts_work(routes: int, experts_used: int, rows_read: int, hidden: int, intermediate: int,
                     x_scale_row_bytes: int) -> tuple[int, int]:
    """(flops, bytes) of the fp8 experts stage, as expert_work counts the bf16 one, at fp8 sizes: the e4m3
    weights (+ fp32 128x128 block scales) of each expert with a route, the staged rows (+ their scales) of tokens
    with a route, act [routes, I] e4m3 (+ one fp32 scale per 128 columns) written and read back, y [routes, H]
    bf16 written."""
    H, I = hidden, intermediate
    flops = 2 * routes * (H * 2 * I + I * H)
    nbytes = (experts_used * (3 * H * I + 3 * H * I // WEIGHT_BLOCK ** 2 * 4)
              + rows_read * (H + x_scale_row_bytes)
              + routes * ((I + I // ACT_GROUP * 4) * 2 + H * 2))
    return flops, nbytes
