"""fp32 -> output dtype at a kernel's store, rounded as the GPU rounds it, also under the CPU interpreter (whose
fp32 -> bf16 cast truncates). Shared by masked_moe_sum and the grouped GEMMs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import interpreting


@triton.jit
def round_store_value(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 -> output dtype. SOFT_BF16 (CPU interpreter only, whose fp32->bf16 cast truncates): round to nearest
    even on the bit pattern, as the GPU's cvt.rn does, so CPU results match the GPU's rounding."""
    if SOFT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


def soft_bf16(t: torch.Tensor) -> bool:
    """Whether stores into `t` need round_store_value's SOFT_BF16 path (bf16 output under the interpreter)."""
    return interpreting() and t.dtype == torch.bfloat16
