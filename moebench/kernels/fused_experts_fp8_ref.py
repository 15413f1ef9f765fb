"""The dequantised reference of fused_experts_fp8, and the error bound its check uses.

`fused_experts_fp8_torch`: the staged rows and the block-quantised weights dequantised to fp32 (exactly: an e4m3
value times its scale), then fused_experts_torch's semantics in fp32, with the one step the fp8 path adds: the
SwiGLU output re-quantised per row per 128 columns by the same recipe as the kernel (requantize_rows_fp8_torch).
Both sides therefore see the same fp8 inputs; what can differ is bounded element by element:

  GEMM 1  h_j = sum_k x_k W1_jk. Products of e4m3 values are exact in fp32; the sums are not, in either the kernel
          or the reference: |dh_j| <= g1 * S1_j with S1_j = sum_k |x_k||W1_jk| (g1 = ErrorModel.gemm1_rel), plus,
          for the UE8M0 group-32 rows, the exact effect of the kernel's exponent alignment sum_k |dx_k||W1_jk|.
  SwiGLU  a = silu(g) * u: |da| <= 1.1|u| dg + |silu(g)| du + 1.1 dg du + 2^-21 |a|   (|silu'| <= 1.0998)
  requant s = max(amax, 1e-4) / 448 moves by ds <= max_group(da) / 448; q = a / s moves by
          dq <= (da + |a| ds / s) / s. The e4m3 value of q moves only if q +- dq crosses a rounding midpoint, and
          then by whole e4m3 steps: dQ = max(|Q(q + dq) - Q(q)|, |Q(q) - Q(q - dq)|), evaluated exactly, so
          d(a_hat) <= s dQ + ds (|Q| + dQ). Elements far from a midpoint contribute nothing: this is where the
          fp8 rounding enters the bound, one e4m3 step (2^-3 relative, twice the 2^-4 unit roundoff) per flip.
  GEMM 2  |dy_n| <= sum_j d(a_hat)_j |W2_nj| + g2 * sum_j |a_hat_j||W2_nj|, then times the top-k weight
  stores  y rounded to bf16 (2^-8 relative: 8 significant bits), the fp32 slot sum (K * 2^-24), out rounded
          to bf16 (2^-8).
The check is elementwise (|out - ref| <= bound everywhere); the max / RMS relative limits it reports are the
bound's own max and RMS relative to the reference, so they are derived per shape, not picked.

g1, g2: fp32 accumulation, worst case in any order, n * 2^-24 for the reference; for the kernel under the
interpreter the same per K step plus the promotions; on a GPU the fp8 tensor-core accumulation within one
128-deep K step is taken as FP8_MMA_REL of the step's sum |products| (an assumption from DeepSeek-V3's report of
a ~14-bit accumulator; the only constant of the bound not from fp8 / fp32 / bf16 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moebench.kernels.fp8_quant import (
    ACT_GROUP,
    E4M3,
    dequantize_staged,
    dequantize_weights,
    requantize_rows_fp8_torch,
    staged_scales,
)
from moebench.kernels.fused_experts_fp8 import BLOCK_K, check_fp8_args
from moebench.kernels.prepare_moe_inputs import AMAX_FLOOR, FP8_MAX

__all__ = ["ErrorModel", "error_model", "FP8_MMA_REL", "fused_experts_fp8_torch", "fp8_reference_with_bound",
           "reference_from_dequantised", "kernel_view_of_x", "requant_deviation"]

U32 = 2.0 ** -24  # fp32 unit roundoff
BF16_REL = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)
FP8_MMA_REL = 2.0 ** -12  # assumed: Hopper fp8 MMA accumulation error within one K step, of sum |products|
SILU_SLOPE = 1.1  # >= max |silu'|


@dataclass(frozen=True)
class ErrorModel:
    gemm1_rel: float  # |h_kernel - h_ref| <= gemm1_rel * sum |x||W1| (both sides' accumulation)
    gemm2_rel: float
    h_store_rel: float = 0.0  # the gate/up output rounded before the SwiGLU (the peer's bf16 h)
    y_store_rel: float = BF16_REL  # per-route y in bf16
    out_store_rel: float = BF16_REL  # out in bf16


def error_model(device: torch.device, hidden: int, intermediate: int, *, h_store_rel: float = 0.0) -> ErrorModel:
    """The accumulation terms for GEMMs of depth hidden / intermediate, kernel on `device`."""
    def rel(n: int) -> float:
        ref = (n + 8) * U32  # fp32 matmul in any order + the dequantisation products
        if device.type == "cuda":
            kernel = FP8_MMA_REL + (n // BLOCK_K + 4) * U32
        else:
            kernel = (BLOCK_K + n // BLOCK_K + 4) * U32
        return ref + kernel
    return ErrorModel(rel(hidden), rel(intermediate), h_store_rel=h_store_rel)


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(E4M3).float()


def requant_deviation(a: torch.Tensor, da: torch.Tensor, group: int) -> torch.Tensor:
    """Bound on |a_hat_kernel - a_hat_ref| per element when the kernel's pre-quantisation value is within da of
    the reference's a (see the module docstring)."""
    R, N = a.shape
    a3, da3 = a.reshape(R, N // group, group), da.reshape(R, N // group, group)
    amax = a3.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    s = (amax / amax.new_full((), FP8_MAX))[:, :, None]
    ds = da3.amax(dim=2, keepdim=True) / FP8_MAX + 2 * U32 * s
    q = a3 * (s.new_ones(()) / s)
    dq = (da3 + a3.abs() * ds / s) / s + 4 * U32 * q.abs()
    Q = _e4m3(q)
    dQ = torch.maximum((_e4m3(q + dq) - Q).abs(), (Q - _e4m3(q - dq)).abs())
    return (s * dQ + ds * (Q.abs() + dQ)).reshape(R, N)


def kernel_view_of_x(x_q: torch.Tensor, x_scales: torch.Tensor, group_size: int, scale_format: str) -> torch.Tensor:
    """fp32 [M, H]: the activation values the kernel multiplies. UE8M0 group 32: per 128-column K step the four
    sub-groups aligned to the largest exponent and re-cast to e4m3 (exact unless a value leaves e4m3's normal
    range), times the step's largest scale; every other layout: the staged values times their scales."""
    if not (scale_format == "ue8m0_packed" and group_size == 32):
        return dequantize_staged(x_q, x_scales, group_size, scale_format)
    M, H = x_q.shape
    e = (staged_scales(x_scales, group_size, scale_format, H).view(torch.int32) >> 23).reshape(M, H // 128, 4)
    e_max = e.amax(dim=2, keepdim=True)
    factor = ((e - e_max + 127).clamp_min(1) << 23).view(torch.float32)
    aligned = (x_q.float().reshape(M, H // 128, 4, 32) * factor[..., None]).to(E4M3).float()
    return (aligned * (e_max << 23).view(torch.float32)[..., None]).reshape(M, H)


def reference_from_dequantised(x: torch.Tensor, w13_of: Callable[[int], torch.Tensor],
                               w2_of: Callable[[int], torch.Tensor], topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, num_experts: int, *, act_group: int = ACT_GROUP,
                               model: ErrorModel | None = None, x_err: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out fp32 [M, H], bound fp32 [M, H] or None). x fp32 [M, H] dequantised rows; w13_of(e) / w2_of(e) the
    dequantised fp32 weights of expert e ([2I, H] / [H, I]); act re-quantised per row per `act_group` columns.
    With `model`, also the elementwise bound on |kernel - reference| (module docstring); x_err: the kernel's
    deviation from x per element (the UE8M0 alignment), or None."""
    M, H = x.shape
    K = topk_ids.shape[1]
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    per_slot = torch.zeros(M, K, H, dtype=torch.float32, device=x.device)
    slot_bound = torch.zeros_like(per_slot) if model is not None else None
    for e in range(num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w1, w2 = w13_of(e), w2_of(e)
        inter = w1.shape[0] // 2
        rows = x.index_select(0, tok)
        h = rows @ w1.T
        g, u = h[:, :inter], h[:, inter:]
        a = torch.nn.functional.silu(g) * u
        a_q, a_s = requantize_rows_fp8_torch(a, act_group)
        a_hat = (a_q.float().reshape(-1, inter // act_group, act_group) * a_s[:, :, None]).reshape(-1, inter)
        y = a_hat @ w2.T
        weight = topk_weights[tok, slot].float()[:, None]
        per_slot[tok, slot] = y * weight
        if model is None:
            continue
        w1_abs, w2_abs = w1.abs(), w2.abs()
        dh = model.gemm1_rel * (rows.abs() @ w1_abs.T) + model.h_store_rel * h.abs()
        if x_err is not None:
            dh = dh + x_err.index_select(0, tok) @ w1_abs.T
        dg, du = dh[:, :inter], dh[:, inter:]
        da = (SILU_SLOPE * u.abs() * dg + torch.nn.functional.silu(g).abs() * du + SILU_SLOPE * dg * du
              + 8 * U32 * a.abs())
        da_hat = requant_deviation(a, da, act_group)
        dy = da_hat @ w2_abs.T + model.gemm2_rel * (a_hat.abs() @ w2_abs.T)
        slot_bound[tok, slot] = weight * (dy * (1 + model.y_store_rel + U32) + model.y_store_rel * y.abs())
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for k in range(K):
        out += torch.where(valid[:, k, None], per_slot[:, k], 0.0)
    if model is None:
        return out, None
    summed = slot_bound.sum(dim=1) + K * U32 * per_slot.abs().sum(dim=1)
    bound = summed + model.out_store_rel * (out.abs() + summed)
    return out, bound


def _weights_of(w_q: torch.Tensor, scales: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda e: dequantize_weights(w_q[e], scales[e])  # one expert at a time: small fp32 temporaries


def fp8_reference_with_bound(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales, *,
                             group_size: int, scale_format: str, model: ErrorModel | None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(reference out fp32, elementwise bound or None) for fused_experts_fp8's arguments."""
    M, K, E, H, I = check_fp8_args(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales,
                                   group_size, scale_format)
    x = dequantize_staged(x_q, x_scales, group_size, scale_format)
    x_err = None
    if model is not None and scale_format == "ue8m0_packed" and group_size == 32:
        x_err = (kernel_view_of_x(x_q, x_scales, group_size, scale_format) - x).abs()
    return reference_from_dequantised(x, _weights_of(w13_q, w13_scales), _weights_of(w2_q, w2_scales), topk_ids,
                                      topk_weights, E, model=model, x_err=x_err)


def fused_experts_fp8_torch(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales, *,
                            group_size: int, scale_format: str, out_dtype: torch.dtype = torch.bfloat16
                            ) -> torch.Tensor:
    """The dequantised reference (module docstring), out in out_dtype (fp32 sum rounded once)."""
    out, _ = fp8_reference_with_bound(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales,
                                      group_size=group_size, scale_format=scale_format, model=None)
    return out.to(out_dtype)
