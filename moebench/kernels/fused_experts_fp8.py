"""fused_experts_fp8: the routed experts' SwiGLU MLPs on the fp8 rows `prepare_moe_inputs` stages.

    out[m] = sum over valid k of topk_weights[m,k] * (requant(silu(x[m] @ w13[e,:I].T) * (x[m] @ w13[e,I:].T))
             @ w2[e].T),   x = x_q * group scales, w = w_q * 128x128 block scales, requant = e4m3 per 128 columns

Same pipeline, skipping and launcher as the bf16 `fused_experts`: grouped_gemm's alignment, workspace
(precision "fp8_block"), tile prologue and persistent launch, with the kernels below: fp8 gate/up + SwiGLU (+
re-quantisation) -> fp8 down + top-k weight -> deterministic slot sum; -1 and ids >= E are never placed, so they
cost no GEMM work; persistent programs read the block count on the device (no host sync, graph capturable).
Configs (FP8_CANDIDATES, choose_fp8_config, fp8_choice) are kernels._details.experts_config's, re-exported here.

Numerics (Hopper, DeepSeek-V3 style): BLOCK_K = 128, so each K step has one weight scale per 128 output columns
and one activation scale per row; the step's fp8 MMA result (fp32) is multiplied by a_scale[row] * w_scale[col]
and added to an fp32 accumulator ("promotion" every 128 K, which also bounds the reach of the tensor cores'
reduced-precision fp8 accumulation). Activation scale layouts:
  fp32, group_size a multiple of 128       one scale per row per K step (group 128: the step's own)
  ue8m0_packed, group_size a multiple of 128  the same, the scale an exponent byte of the packed words
  ue8m0_packed, group_size 32 (DeepSeek-V4)   one int32 word per row per K step holds the 4 exponents; the four
        32-column sub-groups are aligned to the largest exponent in registers (x_q * 2^(e_j - e_max), re-cast to
        e4m3: exact unless a value drops below e4m3's normal range, where it rounds to a multiple of 2^-9 of the
        row's scale), and the step uses the row scale 2^(e_max-127). Cost: ~4 ALU ops per A element per K step,
        shared by all 2*BLOCK_N columns (1 per 256 MMA FLOPs); four 32-deep sub-dots would instead rescale the
        whole [BM, 2*BN] accumulator four times per step (4x the promotion FMAs) and serialise the MMAs.
Re-quantisation of the SwiGLU output happens in the gate/up epilogue on the fp32 tile (BLOCK_N = 128 per half,
so a program owns whole 128-column groups): act is written once as e4m3 + one fp32 scale per 128 columns (1.03
bytes per element) instead of bf16 written, read and re-written as fp8 by a separate kernel (5 bytes).
The per-route output y is bf16, summed over slots in fp32 by the bf16 path's sum_slots.

Register budget: the promotion keeps the step's MMA result beside the accumulator, so a [BM, 2*BN] program holds
2 x BM x 256 fp32: 64 rows over 8 warps or 128 rows over 16 warps (bm128_w16_down128) is 128 registers a thread.
RESCALE (GemmConfig.rescale) keeps one copy instead: 128 rows over 8 warps (bm128_w8r, the prefill default), two
warpgroups of 64 x 128 MMAs where 16 warps run four of 64 x 64. With a 128-row tile the group-32 ue8m0 layout's
in-register exponent alignment spills, so that layout launches 64-row tiles (experts_config.fit_fp8_layout).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from moebench.kernels._details.experts_config import (FP8_BLOCK, FP8_BLOCK_K, FP8_CANDIDATES, ExpertsConfig,
                                                      Fp8ExpertsConfig, Fp8GemmConfig, choose_fp8_config,
                                                      experts_choice, fit_fp8_config, fit_fp8_layout)
from moebench.kernels._details.jit import check_triton_device
from moebench.kernels._details.rounding import round_store_value, soft_bf16
from moebench.kernels._details.tuning import Choice
from moebench.kernels.fp8_quant import ACT_GROUP, E4M3, WEIGHT_BLOCK, quantize_rows_tile, soft_fp8, to_e4m3
from moebench.kernels.grouped_gemm import (
    ExpertsWorkspace,
    check_routes,
    checked_workspace,
    expert_operand_shapes,
    gate_up_rows,
    launch_config,
    launch_persistent,
    make_workspace,
    routes_alignment,
    sum_slots,
    tile_prologue,
)

__all__ = ["Fp8GemmConfig", "Fp8ExpertsConfig", "FP8_CANDIDATES", "choose_fp8_config", "fit_fp8_config",
           "fp8_choice", "Fp8ExpertsWorkspace", "make_fp8_workspace", "fused_experts_fp8", "fp8_expert_gemms",
           "check_fp8_args", "x_scale_mode"]

BLOCK_K = FP8_BLOCK_K  # one weight scale block (and, for group >= 128, one activation scale) per K step

# activation scale layouts (the kernels' X_SCALE)
_X_FP32, _X_UE8M0_BYTE, _X_UE8M0_WORD32 = 0, 1, 2

Fp8ExpertsWorkspace = ExpertsWorkspace  # the one workspace type; fp8's has act e4m3 and act_scales


def fp8_choice(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, device=None,
               config: str | ExpertsConfig | None = None, *, group_size: int | None = None,
               scale_format: str | None = None) -> Choice:
    """fused_experts_fp8's launch config: experts_choice with precision "fp8_block" (an FP8_CANDIDATES name,
    fitted to H, or an fp8 ExpertsConfig launched as given; else the tuned table; else choose_fp8_config), fitted
    to the activation-scale layout when it is given (experts_config.fit_fp8_layout)."""
    choice = experts_choice(num_tokens, top_k, num_experts, hidden, intermediate, device, config, precision=FP8_BLOCK)
    return fit_fp8_layout(choice, hidden, group_size, scale_format)


def make_fp8_workspace(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, *,
                       config: ExpertsConfig | str | None = None, device: torch.device | str = "cuda",
                       group_size: int | None = None, scale_format: str | None = None) -> ExpertsWorkspace:
    """`config`: an fp8 ExpertsConfig, an FP8_CANDIDATES name, or None ("auto"): fp8_choice's, for the activation
    scale layout (group_size, scale_format) the workspace will run when given."""
    choice = fp8_choice(num_tokens, top_k, num_experts, hidden, intermediate, device, config, group_size=group_size,
                        scale_format=scale_format)
    return make_workspace(num_tokens, top_k, num_experts, hidden, intermediate, config=choice, device=device,
                          precision=FP8_BLOCK)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _x_step(a, xs_row, row_ok, kb, offs_k, X_SCALE: tl.constexpr, GROUP_STEPS: tl.constexpr,
            SOFT_FP8: tl.constexpr):
    """The A tile `a` of K step kb (fp8 [BM, BLOCK_K], as loaded) as the MMA takes it, and its per-row scale [BM]
    fp32."""
    if X_SCALE == 2:  # ue8m0 group 32: word kb holds the step's 4 exponents; align them to the largest
        word = tl.load(xs_row + kb, mask=row_ok, other=0)
        e_max = tl.maximum(tl.maximum(word & 0xFF, (word >> 8) & 0xFF),
                           tl.maximum((word >> 16) & 0xFF, (word >> 24) & 0xFF))
        e = (word[:, None] >> ((offs_k // 32) * 8)[None, :]) & 0xFF
        shift = tl.maximum(e - e_max[:, None] + 127, 1)  # 2^(e - e_max); <= 2^-126 flushes to 0 in e4m3 anyway
        a = to_e4m3(a.to(tl.float32) * (shift << 23).to(tl.float32, bitcast=True), SOFT_FP8)
        s = (e_max << 23).to(tl.float32, bitcast=True)
    elif X_SCALE == 1:  # ue8m0, group >= 128: byte gi of the packed words
        gi = kb // GROUP_STEPS
        word = tl.load(xs_row + gi // 4, mask=row_ok, other=0)
        s = (((word >> ((gi % 4) * 8)) & 0xFF) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.load(xs_row + kb // GROUP_STEPS, mask=row_ok, other=0.0)
    return a, s


@triton.jit
def _fp8_gate_up_kernel(x_ptr, xs_ptr, w13, w13s_ptr, act_ptr, acts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                        num_routes, top_k, hidden, inter, num_programs,
                        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_am, stride_asm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        X_SCALE: tl.constexpr, GROUP_STEPS: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                        ACT_TMA: tl.constexpr, RESCALE: tl.constexpr, FLATTEN: tl.constexpr,
                        WARP_SPEC: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Persistent over the tiles of the blocks that exist. w13: e4m3 [E, 2I, H] (or a TMA descriptor over its
    [E*2I, H] view, [BLOCK_N, BLOCK_K] boxes); w13s: fp32 [E, 2I/128, H/128]. Writes act (e4m3, sorted
    positions x I) and its scales (fp32 [positions, I/128]); BLOCK_N == 128 == the re-quantisation group.
    ACT_TMA: x_ptr is a TMA descriptor over the staged rows (kernels.stage_rows) with [BLOCK_M, BLOCK_K] boxes,
    else x's rows are gathered by token. FLATTEN: the tile loop and the K loop in one software pipeline.
    RESCALE: promotion without the step's result beside the accumulator: each accumulator is carried in units of
    the last step's scale f = a_scale[row] * w_scale (one weight block a tile), multiplied by f_prev / f before the
    step's MMA accumulates into it in place and by the last f at the end; one fp32 multiply a step like the
    promotion's, half the fp32 registers (a 128-row tile fits 8 warps: two warpgroups of 64 x 128 MMAs)."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = inter // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
        pid_n, first_row, expert, offs_m, route, row_ok = tile_prologue(tile, num_pid_m, num_pid_n, sorted_ptr,
                                                                        expert_ids_ptr, num_routes, BLOCK_M, GROUP_M)
        token = (route // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if not ACT_TMA:
            x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
        xs_row = xs_ptr + token * stride_xsm
        gs_ptr = w13s_ptr + expert * stride_wse + pid_n * stride_wsn  # scale row of the gate block, + kb
        us_ptr = gs_ptr + (inter // BLOCK_K) * stride_wsn
        if WEIGHT_TMA:
            gate_row = (expert * 2 * inter + pid_n * BLOCK_N).to(tl.int32)
        else:
            g_ptrs = w13 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
            u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if RESCALE:  # the scale the accumulators are carried in, per row
            unit_g = tl.full((BLOCK_M,), 1.0, tl.float32)
            unit_u = tl.full((BLOCK_M,), 1.0, tl.float32)
        for kb in range(0, hidden // BLOCK_K):
            if ACT_TMA:  # pad rows are zeros in the staged copy
                a = x_ptr.load([first_row.to(tl.int32), kb * BLOCK_K])
            else:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            a, sa = _x_step(a, xs_row, row_ok, kb, offs_k, X_SCALE, GROUP_STEPS, SOFT_FP8)
            if WEIGHT_TMA:
                g = tl.trans(w13.load([gate_row, kb * BLOCK_K]))
                u = tl.trans(w13.load([gate_row + inter, kb * BLOCK_K]))
            else:
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            sg = tl.load(gs_ptr + kb)
            su = tl.load(us_ptr + kb)
            if UPCAST_DOT:  # the interpreter's dot on fp8 operands; fp32 products of e4m3 values are exact
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            if RESCALE:  # acc in units of this step's scale: the MMA accumulates in place, no second fp32 tile
                fg = sa * sg
                fu = sa * su
                fg = tl.where(fg == 0.0, 1.0, fg)  # pad rows (their A rows are zeros)
                fu = tl.where(fu == 0.0, 1.0, fu)
                acc_g = tl.dot(a, g, acc_g * (unit_g / fg)[:, None])
                acc_u = tl.dot(a, u, acc_u * (unit_u / fu)[:, None])
                unit_g = fg
                unit_u = fu
            else:
                acc_g += tl.dot(a, g) * (sa * sg)[:, None]
                acc_u += tl.dot(a, u) * (sa * su)[:, None]
            if not ACT_TMA:
                x_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
        if RESCALE:
            acc_g = acc_g * unit_g[:, None]
            acc_u = acc_u * unit_u[:, None]
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        q, s = quantize_rows_tile(act, SOFT_FP8)
        rows = offs_m.to(tl.int64)
        tl.store(act_ptr + rows[:, None] * stride_am + offs_n[None, :], q)
        tl.store(acts_ptr + rows * stride_asm + pid_n, s)


@triton.jit
def _fp8_down_kernel(act_ptr, acts_ptr, w2, w2s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                     num_routes, hidden, inter, num_programs,
                     stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     WEIGHT_TMA: tl.constexpr, ACT_TMA: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
                     UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Persistent like the gate/up kernel. w2: e4m3 [E, H, I] (or a descriptor over [E*H, I]); w2s fp32
    [E, H/128, I/128]; act scales one per row per K step. y[route] = topk_weight * act @ w2[e].T in bf16.
    ACT_TMA: act_ptr is a descriptor over act [positions, I] with [BLOCK_M, BLOCK_K] boxes."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = hidden // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
        pid_n, first_row, expert, offs_m, route, row_ok = tile_prologue(tile, num_pid_m, num_pid_n, sorted_ptr,
                                                                        expert_ids_ptr, num_routes, BLOCK_M, GROUP_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_m.to(tl.int64)
        if not ACT_TMA:
            a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
        as_ptrs = acts_ptr + rows * stride_asm
        ws_ptrs = w2s_ptr + expert * stride_wse + (offs_n // BLOCK_K) * stride_wsn
        if WEIGHT_TMA:
            w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        else:
            w_ptrs = w2 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, inter // BLOCK_K):
            # every row of an existing block was written by the gate/up kernel
            if ACT_TMA:
                a = act_ptr.load([first_row.to(tl.int32), kb * BLOCK_K])
            else:
                a = tl.load(a_ptrs)
            sa = tl.load(as_ptrs + kb)
            if WEIGHT_TMA:
                w = tl.trans(w2.load([w_row, kb * BLOCK_K]))
            else:
                w = tl.load(w_ptrs)
            sw = tl.load(ws_ptrs + kb)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
            if not ACT_TMA:
                a_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                w_ptrs += BLOCK_K
        weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        y_ptrs = y_ptr + route.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, round_store_value(acc, y_ptr.dtype.element_ty, SOFT_BF16), mask=row_ok[:, None])

# ---------------------------------------------------------------------------------------------------------------
# Arguments, the launches, the op
# ---------------------------------------------------------------------------------------------------------------

def x_scale_mode(group_size: int, scale_format: str) -> int:
    """The kernels' X_SCALE for a staged layout, or ValueError for one the kernels do not take."""
    if scale_format == "ue8m0_packed" and group_size == 32:
        return _X_UE8M0_WORD32
    if group_size % BLOCK_K == 0 and scale_format in ("ue8m0_packed", "fp32"):
        return _X_UE8M0_BYTE if scale_format == "ue8m0_packed" else _X_FP32
    raise ValueError(f"fp8 experts take group_size 32 with ue8m0_packed scales or a multiple of {BLOCK_K} with "
                     f"either format; got group_size={group_size}, scale_format={scale_format!r}")


def check_fp8_args(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales, group_size: int,
                   scale_format: str) -> tuple[int, int, int, int, int]:
    """(M, K, E, H, I), or ValueError naming the inconsistent argument."""
    x_scale_mode(group_size, scale_format)
    M, E, H, I = expert_operand_shapes(x_q, w13_q, w2_q, names=("x_q", "w13_q", "w2_q"), dtype=E4M3,
                                       multiple=WEIGHT_BLOCK)
    b = WEIGHT_BLOCK
    for name, s, shape in (("w13_scales", w13_scales, (E, 2 * I // b, H // b)), ("w2_scales", w2_scales, (E, H // b, I // b))):
        if tuple(s.shape) != shape or s.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 {shape}, got {s.dtype} {tuple(s.shape)}")
    if scale_format == "fp32":
        sf_shape, sf_dtype = (M, H // group_size), torch.float32
    else:
        sf_shape, sf_dtype = (M, H // (4 * group_size)), torch.int32
    if tuple(x_scales.shape) != sf_shape or x_scales.dtype != sf_dtype:
        raise ValueError(f"x_scales: expected {sf_dtype} {sf_shape} ({scale_format}, group {group_size}), got "
                         f"{x_scales.dtype} {tuple(x_scales.shape)}")
    return M, check_routes(topk_weights, topk_ids, M), E, H, I


def fused_experts_fp8(x_q: torch.Tensor, x_scales: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13_q: torch.Tensor, w13_scales: torch.Tensor, w2_q: torch.Tensor, w2_scales: torch.Tensor, *,
                      group_size: int, scale_format: str, config: Fp8ExpertsConfig | str | None = None,
                      workspace: Fp8ExpertsWorkspace | None = None, out: torch.Tensor | None = None,
                      alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x_q e4m3 [M,H] + x_scales as prepare_moe_inputs stages them (group_size, scale_format), topk_ids [M,K]
    local ids (-1 and ids >= E skipped, as in fused_experts), topk_weights fp32 [M,K], w13_q e4m3 [E,2I,H] /
    w2_q e4m3 [E,H,I] with fp32 128x128 block scales (quantize_weights_fp8_block) -> out bf16 [M,H].
    No host synchronisation (CUDA-graph capturable). `alignment`: as fused_experts (block_size = the config's
    block_m)."""
    M, K, E, H, I = check_fp8_args(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales,
                                   group_size, scale_format)
    check_triton_device(x_q, x_scales, topk_ids, topk_weights, w13_q, w13_scales, w2_q, w2_scales)
    if out is None:
        out = torch.empty(M, H, dtype=torch.bfloat16, device=x_q.device)
    if M == 0:
        return out
    ws = checked_workspace(workspace, (M, K, E, H, I),
                           lambda: make_fp8_workspace(M, K, E, H, I, config=config, device=x_q.device,
                                                      group_size=group_size, scale_format=scale_format))
    if workspace is not None and ws.choice is not None:
        fitted = fit_fp8_layout(ws.choice, H, group_size, scale_format)
        if fitted.name != ws.choice.name:  # correct, but the launch that spills (fit_fp8_layout)
            warnings.warn(f"fused_experts_fp8: the workspace's {ws.choice.name} was chosen without the activation "
                          f"scales' layout; make_fp8_workspace(..., group_size={group_size}, "
                          f"scale_format={scale_format!r}) launches {fitted.name} for it", RuntimeWarning,
                          stacklevel=2)
    cfg = launch_config(ws, config, x_q.device, FP8_BLOCK)
    x_q, x_scales, w13_q, w2_q = (t if t.is_contiguous() else t.contiguous() for t in (x_q, x_scales, w13_q, w2_q))
    w13_scales, w2_scales = w13_scales.contiguous(), w2_scales.contiguous()
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.float().contiguous()
    alignment = routes_alignment(topk_ids, E, cfg.block_m, ws, alignment)
    if K == 0:
        return out.zero_()
    _gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, ws, cfg, alignment, K, group_size,
           scale_format)
    return sum_slots(ws.y, topk_ids, E, out, block_h=cfg.reduce_block_h)


def fp8_expert_gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, workspace: Fp8ExpertsWorkspace,
                     alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, top_k: int, group_size: int,
                     scale_format: str) -> torch.Tensor:
    """fused_experts_fp8's two grouped GEMMs without its slot sum, for a pipeline that times the reduction as a
    stage of its own: writes workspace.y (bf16 [M*K, H], the rows of placed routes only) and returns it. The
    operands as fused_experts_fp8 takes them (contiguous, topk_weights fp32); `alignment` built with the
    workspace config's block_m."""
    _gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, workspace, workspace.config, alignment,
           top_k, group_size, scale_format)
    return workspace.y


def _gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, ws: ExpertsWorkspace,
           cfg: ExpertsConfig, alignment, top_k: int, group_size: int, scale_format: str) -> None:
    """The two launches, through the shared persistent launcher (grouped_gemm.launch_persistent)."""
    M, H = x_q.shape
    E, inter = w13_q.shape[0], w13_q.shape[1] // 2
    R = M * top_k
    assert cfg.gate_up.block_n == ACT_GROUP, "gate/up BLOCK_N is the re-quantisation group"
    sorted_ids, _, num_post = alignment
    launch_persistent(_fp8_gate_up_kernel, FP8_BLOCK, cfg.block_m, cfg.gate_up, alignment, R, E, ("w13", w13_q),
                      inter, 2, **gate_up_rows(cfg.gate_up, x_q, sorted_ids, num_post, top_k, ws.x_rows, False),
                      xs_ptr=x_scales, w13s_ptr=w13_scales, act_ptr=ws.act,
                      acts_ptr=ws.act_scales, top_k=top_k, hidden=H, inter=inter, stride_xm=x_q.stride(0),
                      stride_xsm=x_scales.stride(0), stride_we=w13_q.stride(0), stride_wn=w13_q.stride(1),
                      stride_wse=w13_scales.stride(0), stride_wsn=w13_scales.stride(1), stride_am=ws.act.stride(0),
                      stride_asm=ws.act_scales.stride(0), X_SCALE=x_scale_mode(group_size, scale_format),
                      RESCALE=cfg.gate_up.rescale,
                      GROUP_STEPS=max(1, group_size // BLOCK_K), SOFT_FP8=soft_fp8())
    launch_persistent(_fp8_down_kernel, FP8_BLOCK, cfg.block_m, cfg.down, alignment, R, E, ("w2", w2_q), H, 1,
                      act=("act_ptr", ws.act), acts_ptr=ws.act_scales, w2s_ptr=w2_scales, y_ptr=ws.y,
                      topk_w_ptr=topk_weights,
                      hidden=H, inter=inter, stride_am=ws.act.stride(0), stride_asm=ws.act_scales.stride(0),
                      stride_we=w2_q.stride(0), stride_wn=w2_q.stride(1), stride_wse=w2_scales.stride(0),
                      stride_wsn=w2_scales.stride(1), stride_ym=ws.y.stride(0), SOFT_BF16=soft_bf16(ws.y))
