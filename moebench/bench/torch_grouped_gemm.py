"""torch's grouped GEMMs as the GEMM ceiling (bench.experts_ceiling) and the torch peers (peers.torch_grouped) call
them: where they run, and their plain-torch definition. Registers no impl.

    torch._grouped_mm(a bf16 [R, K], b bf16 [E, K, N], offs=int32 [E]) -> bf16 [R, N]
    torch._scaled_grouped_mm(a e4m3 [R, K] row-major, b e4m3 [E, K, N] column-major, scale_a fp32 [R],
                             scale_b fp32 [E, N], offs=int32 [E], out_dtype=torch.bfloat16) -> bf16 [R, N]

Group g is rows offs[g-1]:offs[g] of `a` (group 0 starts at row 0) times b[g]; offs are group *ends*, non-decreasing, so an
empty group repeats the previous end. Rows from offs[-1] on are never read and their output rows never written:
torch allocates the output with empty_strided (aten/src/ATen/native/GroupedMMUtils.h,
create_grouped_gemm_output_tensor), so they hold whatever the allocator's memory held. A caller with a static row
count (T*K) sorts the routes it skips past offs[-1] and must never read those rows back.
On CUDA sm90+ the bf16 op takes the CUTLASS path that reads offs on the device ("fast path, no d2h sync needed",
_grouped_mm_cuda in GroupedBlas.cpp); elsewhere (the CPU, older GPUs) it falls back to a loop over groups that
copies offs to the host (_grouped_mm_fallback). torch 2.13's CPU build has no _scaled_grouped_mm kernel at all.

`grouped_mm_loop` / `scaled_grouped_mm_loop` are that definition in plain torch (fp32 products, rounded once to
bf16), with the rows past offs[-1] filled with NaN (never a value a caller may use): the reference of the ceiling's
check, and the stand-in that lets the peers' glue run on a CPU. `TORCH_GEMMS` / `LOOP_GEMMS` bundle each pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["grouped_mm_unavailable", "scaled_grouped_mm_unavailable", "grouped_mm_loop", "scaled_grouped_mm_loop",
           "GroupedGemms", "TORCH_GEMMS", "LOOP_GEMMS", "grouped_mm_problem"]


def grouped_mm_unavailable(device: torch.device) -> str | None:
    """None where torch._grouped_mm (bf16) runs on `device`, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm takes its sync-free path on sm90+ only (older GPUs loop over groups on the host)"
    if device.type not in ("cuda", "cpu"):
        return f"torch._grouped_mm: no kernel for {device.type}"
    return None


def scaled_grouped_mm_unavailable(device: torch.device) -> str | None:
    """None where torch._scaled_grouped_mm (fp8 row-wise) runs on `device`, else why not."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if device.type != "cuda":
        return "torch._scaled_grouped_mm runs on CUDA only (no CPU kernel)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._scaled_grouped_mm needs sm90+"
    return None


def grouped_mm_problem(p) -> str | None:
    """Why torch._grouped_mm cannot take the point's bf16 shapes, or None (the fp8 points' 128x128 weight blocks
    already give _scaled_grouped_mm its 16-byte rows)."""
    if p.hidden % 8 or p.intermediate % 8:
        return "hidden/intermediate: torch._grouped_mm needs multiples of 8 (16-byte rows)"
    return None


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return [(start, end) for start, end in zip([0] + ends[:-1], ends)]


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch._grouped_mm's 2d x 3d definition: out[s:e] = a[s:e] @ b[g] per group (fp32, rounded once); rows from
    offs[-1] on are NaN."""
    out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=out_dtype or a.dtype, device=a.device)
    for g, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            out[start:end] = (a[start:end].float() @ b[g].float()).to(out.dtype)
    return out


def scaled_grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                           offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch._scaled_grouped_mm's row-wise definition: out[s:e] = (a[s:e] * scale_a[s:e]) @ (b[g] * scale_b[g])
    per group (fp32 of the e4m3 values, rounded once); rows from offs[-1] on are NaN."""
    out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=out_dtype, device=a.device)
    for g, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            rows = a[start:end].float() * scale_a[start:end, None]
            out[start:end] = (rows @ (b[g].float() * scale_b[g][None, :])).to(out_dtype)
    return out


@dataclass(frozen=True)
class GroupedGemms:
    """The two grouped GEMMs a pipeline calls (torch's, or their plain-torch definition)."""

    grouped_mm: Callable[..., torch.Tensor]  # (a, b, *, offs) -> out
    scaled_grouped_mm: Callable[..., torch.Tensor]  # (a, b, scale_a, scale_b, *, offs, out_dtype) -> out
    name: str


TORCH_GEMMS = GroupedGemms(lambda a, b, *, offs: torch._grouped_mm(a, b, offs=offs),
                           lambda a, b, sa, sb, *, offs, out_dtype=torch.bfloat16: torch._scaled_grouped_mm(
                               a, b, sa, sb, offs=offs, out_dtype=out_dtype), "torch")
LOOP_GEMMS = GroupedGemms(grouped_mm_loop, scaled_grouped_mm_loop, "plain-torch loop over groups")
