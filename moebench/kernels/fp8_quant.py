"""fp8 e4m3 quantisation for the fp8 expert GEMMs: weights in 128x128 blocks, activations per row group, and
dequantisation of what `prepare_moe_inputs` stages.

One recipe everywhere, the staging's (prepare_moe_inputs's docstring), so a Triton result and its torch reference
agree bit for bit on a GPU: amax (fp32) -> max(amax, 1e-4) -> IEEE division by 448 -> IEEE reciprocal -> one
multiply -> round-to-nearest-even cast to e4m3fn.

Triton's CPU interpreter rounds fp32 -> e4m3 wrongly (ties, and a carry into the next binade is lost: 124.4 comes
out 64), but casts exactly representable values exactly. Under the interpreter the kernels therefore round in
fp32 arithmetic first (`to_e4m3` with SOFT), so CPU tests see the GPU's rounding; the hardware cast is what runs
on a GPU, and only GPU tests check it bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, interpreting
from moebench.kernels.prepare_moe_inputs import AMAX_FLOOR, FP8_MAX

E4M3 = torch.float8_e4m3fn
WEIGHT_BLOCK = 128  # weight scale blocks are WEIGHT_BLOCK x WEIGHT_BLOCK (rows x columns of [N, K])
ACT_GROUP = 128  # the re-quantised SwiGLU output: one fp32 scale per row per 128 columns

__all__ = ["E4M3", "WEIGHT_BLOCK", "ACT_GROUP", "to_e4m3", "quantize_rows_tile", "quantize_weights_fp8_block",
           "quantize_weights_fp8_block_torch", "requantize_rows_fp8", "requantize_rows_fp8_torch",
           "staged_scales", "dequantize_staged", "dequantize_weights", "soft_fp8", "requantize_per_row",
           "rowwise_rows", "rowwise_weights"]


def soft_fp8() -> bool:
    """Round fp32 -> e4m3 in fp32 arithmetic before the cast (the CPU interpreter's own cast is wrong)."""
    return interpreting()


@triton.jit
def to_e4m3(v, SOFT: tl.constexpr):
    """fp32 -> float8e4nv, round to nearest even, saturating at +-448 (the recipe never exceeds 448 by more than
    an fp32 rounding, which rounds to 448 either way). SOFT: round first on the fp32 bits (normal range: keep 3
    mantissa bits; subnormal range: multiples of 2^-9 via the 1.5*2^14 magic add), then cast exactly."""
    if SOFT:
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = (tl.abs(v) + 24576.0) - 24576.0
        sub = tl.where(bits < 0, -sub, sub)  # keeps the sign of values that round to zero (-0.0, as the GPU)
        r = tl.where(tl.abs(v) < 0.015625, sub, normal)
        r = tl.minimum(tl.maximum(r, -448.0), 448.0)
        return r.to(tl.float8e4nv)
    else:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def quantize_rows_tile(v, SOFT: tl.constexpr):
    """v [R, G] fp32 -> (q [R, G] e4m3, scale [R] fp32): one scale per row of the tile, the staging's recipe."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
    sf = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    return to_e4m3(v * inv[:, None], SOFT), sf


# ---------------------------------------------------------------------------------------------------------------
# Weights: 128 x 128 blocks, fp32 scales [E, N/128, K/128]
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _quantize_weight_block_kernel(w_ptr, q_ptr, s_ptr, n_blocks, k_blocks, stride_we, stride_wn,
                                  BLOCK: tl.constexpr, SOFT: tl.constexpr):
    pid = tl.program_id(0)
    kb = tl.program_id(1)
    e = (pid // n_blocks).to(tl.int64)
    nb = pid % n_blocks
    rows = nb * BLOCK + tl.arange(0, BLOCK)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    offs = e * stride_we + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    v = tl.load(w_ptr + offs).to(tl.float32)
    # [1]-shaped rather than scalar, so the IEEE div_rn gets tensors of one shape
    amax = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0, keep_dims=True), 1e-4)
    sf = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    tl.store(q_ptr + offs, to_e4m3(v * inv[:, None], SOFT))
    tl.store(s_ptr + pid.to(tl.int64) * k_blocks + kb + tl.arange(0, 1), sf)


def _check_weight(w: torch.Tensor, block: int) -> tuple[int, int, int]:
    if w.dim() != 3 or w.shape[1] % block or w.shape[2] % block:
        raise ValueError(f"weights: expected [E, N, K] with N and K multiples of {block}, got {tuple(w.shape)}")
    return tuple(w.shape)  # type: ignore[return-value]


def quantize_weights_fp8_block(w: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] (bf16/fp16/fp32) -> (w_q e4m3 [E, N, K], scales fp32 [E, N/block, K/block]), one program per
    block. w_q * scale (per block) dequantises; bitwise equal to `quantize_weights_fp8_block_torch` on a GPU."""
    E, N, K = _check_weight(w, block)
    check_triton_device(w)
    w = w.contiguous()
    q = torch.empty(E, N, K, dtype=E4M3, device=w.device)
    s = torch.empty(E, N // block, K // block, dtype=torch.float32, device=w.device)
    if w.numel():
        _quantize_weight_block_kernel[(E * (N // block), K // block)](
            w, q, s, N // block, K // block, w.stride(0), w.stride(1), BLOCK=block, SOFT=soft_fp8(), num_warps=8)
    return q, s


def quantize_weights_fp8_block_torch(w: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of quantize_weights_fp8_block: the same fp32 ops in the same order."""
    E, N, K = _check_weight(w, block)
    v = w.float().reshape(E, N // block, block, K // block, block)
    amax = v.abs().amax(dim=(2, 4)).clamp_min(AMAX_FLOOR)
    sf = amax / amax.new_full((), FP8_MAX)  # tensor / tensor: the IEEE quotient (see prepare_moe_inputs_torch)
    inv = sf.new_ones(()) / sf
    q = (v * inv[:, :, None, :, None]).to(E4M3).reshape(E, N, K)
    return q, sf


def dequantize_weights(w_q: torch.Tensor, scales: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """fp32 w_q * its block scale ([N, K] with [N/b, K/b] scales, or batched [E, N, K])."""
    *lead, N, K = w_q.shape
    v = w_q.float().reshape(*lead, N // block, block, K // block, block)
    return (v * scales.float()[..., :, None, :, None]).reshape(*lead, N, K)


# ---------------------------------------------------------------------------------------------------------------
# Activations: one fp32 scale per row per group of columns
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _requantize_rows_kernel(a_ptr, q_ptr, s_ptr, num_rows, stride_am, stride_qm, stride_sm,
                            ROWS: tl.constexpr, GROUP: tl.constexpr, SOFT: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    ok = rows < num_rows
    rows = rows.to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    v = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    q, sf = quantize_rows_tile(v, SOFT)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + rows * stride_sm + g, sf, mask=ok)


def requantize_rows_fp8(a: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """a [R, N] -> (q e4m3 [R, N], scales fp32 [R, N/group]): the step the gate/up kernel's epilogue performs on
    its fp32 SwiGLU tile (same jit helper), as a standalone kernel for testing the recipe bitwise."""
    if a.dim() != 2 or a.shape[1] % group:
        raise ValueError(f"a: expected [R, N] with N a multiple of {group}, got {tuple(a.shape)}")
    check_triton_device(a)
    R, N = a.shape
    q = torch.empty(R, N, dtype=E4M3, device=a.device)
    s = torch.empty(R, N // group, dtype=torch.float32, device=a.device)
    if R:
        rows = 16
        _requantize_rows_kernel[(triton.cdiv(R, rows), N // group)](
            a, q, s, R, a.stride(0), q.stride(0), s.stride(0), ROWS=rows, GROUP=group, SOFT=soft_fp8(),
            num_warps=4)
    return q, s


def requantize_rows_fp8_torch(a: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of requantize_rows_fp8 (the fp32 scale format of prepare_moe_inputs_torch, group `group`)."""
    R, N = a.shape
    v = a.float().reshape(R, N // group, group)
    amax = v.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    sf = amax / amax.new_full((), FP8_MAX)
    inv = sf.new_ones(()) / sf
    return (v * inv.unsqueeze(2)).to(E4M3).reshape(R, N), sf


# ---------------------------------------------------------------------------------------------------------------
# The staged rows (prepare_moe_inputs' x_fp8 and x_sf)
# ---------------------------------------------------------------------------------------------------------------

def staged_scales(x_sf: torch.Tensor, group_size: int, scale_format: str, hidden: int) -> torch.Tensor:
    """fp32 [M, H/group_size] scales of the staged rows: fp32 as given; ue8m0_packed words unpacked (byte j of
    word w is the exponent of group 4w + j; the scale is 2^(e - 127), built from its bits)."""
    if scale_format == "fp32":
        return x_sf.float()
    M = x_sf.shape[0]
    words = x_sf.to(torch.int64) & 0xFFFFFFFF
    e = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=2).reshape(M, -1)[:, :hidden // group_size]
    return (e.to(torch.int32) << 23).view(torch.float32)


def dequantize_staged(x_q: torch.Tensor, x_sf: torch.Tensor, group_size: int, scale_format: str) -> torch.Tensor:
    """fp32 [M, H]: each staged e4m3 value times its group's scale (exact for UE8M0 scales)."""
    M, H = x_q.shape
    s = staged_scales(x_sf, group_size, scale_format, H)
    return (x_q.float().reshape(M, H // group_size, group_size) * s[:, :, None]).reshape(M, H)


# ---------------------------------------------------------------------------------------------------------------
# Row-wise scales (torch._scaled_grouped_mm's layout), re-quantised from the staged rows and the weight blocks
# ---------------------------------------------------------------------------------------------------------------

def requantize_per_row(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [R, N] -> (q e4m3 [R, N], scales fp32 [R]): one scale per whole row, the staging's recipe."""
    q, s = requantize_rows_fp8_torch(v, v.shape[1])
    return q, s[:, 0].contiguous()


def rowwise_rows(x_q: torch.Tensor, x_sf: torch.Tensor, group_size: int,
                 scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The staged rows (any staged layout) dequantised and re-quantised with one scale per row: (e4m3 [M, H],
    fp32 [M]), as a row-wise serving path would stage them."""
    return requantize_per_row(dequantize_staged(x_q, x_sf, group_size, scale_format))


def rowwise_weights(w_q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantised weights [E, N, K] (+ [E, N/128, K/128] scales) dequantised and re-quantised with one scale
    per output channel: (e4m3 [E, N, K], fp32 [E, N]). One expert at a time (small fp32 temporaries)."""
    per_expert = [requantize_per_row(dequantize_weights(w_q[e], scales[e])) for e in range(w_q.shape[0])]
    if not per_expert:
        return w_q.clone(), torch.empty(0, w_q.shape[1], dtype=torch.float32, device=w_q.device)
    return torch.stack([q for q, _ in per_expert]), torch.stack([s for _, s in per_expert])
