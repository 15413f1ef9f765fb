"""The fp8 peer: torch._scaled_grouped_mm (fp8 e4m3, row-wise fp32 scales, `offs=` group ends), CUDA sm90+.

torch._scaled_grouped_mm(a [rows, K] e4m3 row-major, b [E, K, N] e4m3 column-major (w.transpose(-2, -1) of a
contiguous [E, N, K]), scale_a fp32 [rows], scale_b fp32 [E, N], offs int32 [E] group ends, out_dtype=bf16).

Its scales are row-wise, not block-wise, so it cannot take the staged rows or the block-quantised weights as they
are. Its inputs are re-quantised from those (built once, outside the timed region, as a row-wise serving path
would stage them): x per row from the dequantised staged rows, each weight per output channel from the
dequantised blocks, both with the staging's recipe over the whole row (`rowwise_inputs`). Between the GEMMs the
SwiGLU output (fp32 from the bf16 h) is re-quantised per row, eagerly, inside the timed region. Its numerics
therefore differ from fused_experts_fp8's; its check compares it with the same dequantised reference run on *its*
inputs (row-wise groups, bf16 h), under the same derived bound (fused_experts_fp8_ref), not a loosened one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.kernels.fp8_quant import dequantize_staged, dequantize_weights, requantize_rows_fp8_torch

__all__ = ["scaled_grouped_mm_unavailable", "RowwiseInputs", "rowwise_inputs", "fused_experts_fp8_scaled_grouped_mm"]


def scaled_grouped_mm_unavailable(device: torch.device | None = None) -> str | None:
    """None where the peer can run on `device` (default: the current CUDA device), else the reason."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return "torch._scaled_grouped_mm runs on CUDA only"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._scaled_grouped_mm needs sm90+"
    return None


@dataclass
class RowwiseInputs:
    x_q: torch.Tensor  # e4m3 [M, H]
    x_scales: torch.Tensor  # fp32 [M]
    w13_q: torch.Tensor  # e4m3 [E, 2I, H]
    w13_scales: torch.Tensor  # fp32 [E, 2I]
    w2_q: torch.Tensor  # e4m3 [E, H, I]
    w2_scales: torch.Tensor  # fp32 [E, H]


def _per_row(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = requantize_rows_fp8_torch(v, v.shape[1])
    return q, s[:, 0].contiguous()


def rowwise_inputs(x_q, x_scales, group_size: int, scale_format: str, w13_q, w13_scales, w2_q, w2_scales
                   ) -> RowwiseInputs:
    """The peer's inputs re-quantised from the staged rows and block-quantised weights (module docstring)."""
    xq, xs = _per_row(dequantize_staged(x_q, x_scales, group_size, scale_format))
    w13 = [_per_row(dequantize_weights(w13_q[e], w13_scales[e])) for e in range(w13_q.shape[0])]
    w2 = [_per_row(dequantize_weights(w2_q[e], w2_scales[e])) for e in range(w2_q.shape[0])]
    return RowwiseInputs(xq, xs, torch.stack([q for q, _ in w13]), torch.stack([s for _, s in w13]),
                         torch.stack([q for q, _ in w2]), torch.stack([s for _, s in w2]))


def fused_experts_fp8_scaled_grouped_mm(inp: RowwiseInputs, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Valid routes sorted by expert (stable), both GEMMs through torch._scaled_grouped_mm, eager SwiGLU, per-row
    re-quantisation and weighted slot sum. Synchronises with the host once (the number of valid routes)."""
    M, K = topk_ids.shape
    E, two_i, H = inp.w13_q.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)[:E]
    order = order[:int(counts.sum())]
    offs = counts.cumsum(0).to(torch.int32)
    tok = order // K
    h = torch._scaled_grouped_mm(inp.x_q.index_select(0, tok), inp.w13_q.transpose(-2, -1),
                                 inp.x_scales.index_select(0, tok), inp.w13_scales, offs=offs,
                                 out_dtype=torch.bfloat16)
    act = torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()
    a_q, a_s = _per_row(act)
    y = torch._scaled_grouped_mm(a_q, inp.w2_q.transpose(-2, -1), a_s, inp.w2_scales, offs=offs,
                                 out_dtype=torch.bfloat16)
    per_slot = torch.zeros(M * K, H, dtype=torch.float32, device=topk_ids.device)
    per_slot[order] = y.float() * topk_weights.reshape(-1)[order].float()[:, None]
    res = per_slot.view(M, K, H).sum(1)
    if out is None:
        return res.to(torch.bfloat16)
    out.copy_(res)
    return out
