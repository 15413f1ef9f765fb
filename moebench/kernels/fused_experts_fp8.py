"""fused_experts_fp8: the routed experts' SwiGLU MLPs on the fp8 rows `prepare_moe_inputs` stages.

    out[m] = sum over valid k of topk_weights[m,k] * (requant(silu(x[m] @ w13[e,:I].T) * (x[m] @ w13[e,I:].T))
             @ w2[e].T),   x = x_q * group scales, w = w_q * 128x128 block scales, requant = e4m3 per 128 columns

Same pipeline and skipping as the bf16 `fused_experts` (`grouped_gemm`): align_routes -> fp8 gate/up + SwiGLU
(+ re-quantisation) -> fp8 down + top-k weight -> deterministic slot sum; -1 and ids >= E are never placed, so
they cost no GEMM work; persistent programs read the block count on the device (no host sync, graph capturable).

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

Register budget (why BLOCK_M 64 for the gate/up GEMM): the promotion keeps the step's MMA result beside the
accumulator, so a [BM, 2*BN] program holds 2 x BM x 256 fp32; 64 x 256 over 8 warps is 128 registers a thread.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, interpreting
from moebench.kernels._details.rounding import round_store_value, soft_bf16
from moebench.kernels._details.tuning import Choice, Tunable, choose, pow2_bucket, register_tunable
from moebench.kernels.fp8_quant import ACT_GROUP, E4M3, WEIGHT_BLOCK, quantize_rows_tile, soft_fp8, to_e4m3
from moebench.kernels.fused_experts import alignment_buffers, check_routes, checked_workspace, routes_alignment
from moebench.kernels.grouped_gemm import (
    max_blocks,
    persistent_programs,
    sum_slots,
    swizzle,
    weight_operand,
)

__all__ = ["Fp8GemmConfig", "Fp8ExpertsConfig", "FP8_CANDIDATES", "choose_fp8_config", "fp8_choice",
           "Fp8ExpertsWorkspace", "make_fp8_workspace", "fused_experts_fp8", "fp8_expert_gemms", "check_fp8_args",
           "x_scale_mode"]

BLOCK_K = 128  # one weight scale block (and, for group >= 128, one activation scale) per K step

# activation scale layouts (the kernels' X_SCALE)
_X_FP32, _X_UE8M0_BYTE, _X_UE8M0_WORD32 = 0, 1, 2


# ---------------------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8GemmConfig:
    block_n: int  # gate/up: columns of each half, always 128 (one re-quantisation group); down: 128 or 256
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    weight_tma: bool = True

    @property
    def block_k(self) -> int:
        return BLOCK_K

    def short(self) -> str:
        return f"N{self.block_n}w{self.num_warps}s{self.num_stages}g{self.group_m}" + ("tma" if self.weight_tma else "")


@dataclass(frozen=True)
class Fp8ExpertsConfig:
    block_m: int
    gate_up: Fp8GemmConfig
    down: Fp8GemmConfig
    reduce_block_h: int = 1024
    name: str = ""

    def short(self) -> str:
        return (f"{self.name + ' ' if self.name else ''}BM{self.block_m} up:{self.gate_up.short()} "
                f"down:{self.down.short()}")


# The candidate table (`config:` of a sweep, `moebench tune sweeps/tune_experts_fp8.yaml`): the rule's decode tiers
# and prefill-sized tiles (>= 128 routes per expert). Shared memory per stage of the BM64 ones: A BM x 128 B +
# weights (2x)BN x 128 B: 40 KiB (<= 4 stages fit). Untuned on a GPU so far: the register/shared-memory-feasible
# Hopper tiles (see the module docstring).
FP8_CANDIDATES: dict[str, Fp8ExpertsConfig] = {c.name: c for c in (
    # decode: weight-bandwidth bound, mma.sync tiles, many programs
    Fp8ExpertsConfig(16, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4), name="bm16"),
    Fp8ExpertsConfig(32, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4), name="bm32"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 4), Fp8GemmConfig(256, 8, 8, 4), name="bm64_s4"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 3), Fp8GemmConfig(256, 8, 8, 3), name="bm64_s3"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 16, 8, 4), Fp8GemmConfig(128, 16, 4, 4), name="bm64_g16_down128"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 4, weight_tma=False), Fp8GemmConfig(256, 8, 8, 4, weight_tma=False),
                     name="bm64_s4_notma"),
)}


def fit_fp8_config(cfg: Fp8ExpertsConfig, hidden: int) -> Fp8ExpertsConfig:
    """A candidate fitted to H: the down GEMM's BLOCK_N must divide it, the reduction's block at most next_pow2(H)."""
    if hidden % cfg.down.block_n:
        cfg = dataclasses.replace(cfg, down=dataclasses.replace(cfg.down, block_n=128))
    return dataclasses.replace(cfg, reduce_block_h=min(cfg.reduce_block_h, triton.next_power_of_2(hidden)))


def choose_fp8_config(num_routes: int, num_experts: int, hidden: int, intermediate: int) -> Fp8ExpertsConfig:
    """The rule (the config where the tuned table has no entry), deterministic from the host-known shapes (like
    `choose_config`): BM16 / BM32 / bm64_s4 by rows per expert (<= 24, <= 48, more)."""
    if interpreting():
        # the interpreter's cost is per program and op: small M blocks, whole-ish N
        return Fp8ExpertsConfig(16, Fp8GemmConfig(128, 4, 4, 1, weight_tma=False),
                                Fp8GemmConfig(128, 4, 4, 1, weight_tma=False),
                                reduce_block_h=min(1024, triton.next_power_of_2(hidden)), name="interp")
    rows_per_expert = num_routes / max(1, num_experts)
    name = "bm16" if rows_per_expert <= 24 else "bm32" if rows_per_expert <= 48 else "bm64_s4"
    return fit_fp8_config(FP8_CANDIDATES[name], hidden)


def _fp8_rule(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int):
    cfg = choose_fp8_config(num_tokens * top_k, num_experts, hidden, intermediate)
    return cfg.name, cfg


register_tunable(Tunable(
    "fused_experts_fp8", FP8_CANDIDATES,
    lambda num_tokens, top_k, num_experts, hidden, intermediate:
        f"T={pow2_bucket(num_tokens)},K={top_k},E={num_experts},H={hidden},I={intermediate}",
    _fp8_rule, "choose_fp8_config: bm16 / bm32 / bm64_s4 by rows per expert (<= 24, <= 48, more); the "
               "interpreter: small tiles"))


def fp8_choice(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, device=None,
               config: str | Fp8ExpertsConfig | None = None) -> Choice:
    """fused_experts_fp8's launch config on `device`: `config` (an FP8_CANDIDATES name, fitted to H, or an
    Fp8ExpertsConfig, launched as given), else the tuned table (bucket T=next_pow2(tokens),K,E,H,I), else
    choose_fp8_config."""
    choice = choose("fused_experts_fp8", device, config, num_tokens=num_tokens, top_k=top_k,
                    num_experts=num_experts, hidden=hidden, intermediate=intermediate)
    if isinstance(config, Fp8ExpertsConfig) or choice.source == "rule":
        return choice
    return dataclasses.replace(choice, config=fit_fp8_config(choice.config, hidden))


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _x_step(x_ptrs, xs_row, row_ok, kb, offs_k, X_SCALE: tl.constexpr, GROUP_STEPS: tl.constexpr,
            SOFT_FP8: tl.constexpr):
    """The A tile of K step kb (fp8 [BM, BLOCK_K]) and its per-row scale [BM] fp32."""
    a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
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
                        UPCAST_DOT: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Persistent over the tiles of the blocks that exist. w13: e4m3 [E, 2I, H] (or a TMA descriptor over its
    [E*2I, H] view, [BLOCK_N, BLOCK_K] boxes); w13s: fp32 [E, 2I/128, H/128]. Writes act (e4m3, sorted
    positions x I) and its scales (fp32 [positions, I/128]); BLOCK_N == 128 == the re-quantisation group."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = inter // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        route = tl.load(sorted_ptr + offs_m)
        row_ok = route < num_routes
        token = (route // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        for kb in range(0, hidden // BLOCK_K):
            a, sa = _x_step(x_ptrs, xs_row, row_ok, kb, offs_k, X_SCALE, GROUP_STEPS, SOFT_FP8)
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
            acc_g += tl.dot(a, g) * (sa * sg)[:, None]
            acc_u += tl.dot(a, u) * (sa * su)[:, None]
            x_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
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
                     WEIGHT_TMA: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Persistent like the gate/up kernel. w2: e4m3 [E, H, I] (or a descriptor over [E*H, I]); w2s fp32
    [E, H/128, I/128]; act scales one per row per K step. y[route] = topk_weight * act @ w2[e].T in bf16."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = hidden // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        route = tl.load(sorted_ptr + offs_m)
        row_ok = route < num_routes
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_m.to(tl.int64)
        a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
        as_ptrs = acts_ptr + rows * stride_asm
        ws_ptrs = w2s_ptr + expert * stride_wse + (offs_n // BLOCK_K) * stride_wsn
        if WEIGHT_TMA:
            w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        else:
            w_ptrs = w2 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, inter // BLOCK_K):
            a = tl.load(a_ptrs)  # every row of an existing block was written by the gate/up kernel
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
            a_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                w_ptrs += BLOCK_K
        weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        y_ptrs = y_ptr + route.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, round_store_value(acc, y_ptr.dtype.element_ty, SOFT_BF16), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------------------------
# Arguments, workspace, the op
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
    if x_q.dim() != 2 or x_q.dtype != E4M3:
        raise ValueError(f"x_q: expected e4m3fn [M, H], got {x_q.dtype} {tuple(x_q.shape)}")
    M, H = x_q.shape
    if w13_q.dim() != 3 or w13_q.shape[2] != H or w13_q.shape[1] % 2 or w13_q.dtype != E4M3:
        raise ValueError(f"w13_q: expected e4m3fn [E, 2I, H={H}], got {w13_q.dtype} {tuple(w13_q.shape)}")
    E, I = w13_q.shape[0], w13_q.shape[1] // 2
    if H % WEIGHT_BLOCK or I % WEIGHT_BLOCK:
        raise ValueError(f"hidden ({H}) and intermediate ({I}) must be multiples of {WEIGHT_BLOCK}")
    if tuple(w2_q.shape) != (E, H, I) or w2_q.dtype != E4M3:
        raise ValueError(f"w2_q: expected e4m3fn [E={E}, H={H}, I={I}], got {w2_q.dtype} {tuple(w2_q.shape)}")
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


@dataclass
class Fp8ExpertsWorkspace:
    """Everything fused_experts_fp8 writes besides `out`, preallocated so a timed call allocates nothing."""

    config: Fp8ExpertsConfig
    shape: tuple[int, int, int, int, int]  # (M, K, E, H, I)
    sorted_ids: torch.Tensor  # int32 [R + E*(BM-1)]
    expert_ids: torch.Tensor  # int32 [cdiv(that, BM)]
    num_post: torch.Tensor  # int32 [1]
    align_scratch: torch.Tensor  # int32 [align_scratch_size(R, E)]
    act_q: torch.Tensor  # e4m3 [max_blocks*BM, I]: re-quantised SwiGLU output per sorted position
    act_scales: torch.Tensor  # fp32 [max_blocks*BM, I/128]
    y: torch.Tensor  # bf16 [R, H]: weighted expert output per route
    choice: Any = None  # the tuning.Choice `config` came from (name, explicit | table | rule), for the records

    def fits(self, M: int, K: int, E: int, H: int, I: int) -> bool:
        return self.shape == (M, K, E, H, I)


def make_fp8_workspace(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, *,
                       config: Fp8ExpertsConfig | str | None = None, device: torch.device | str = "cuda"
                       ) -> Fp8ExpertsWorkspace:
    """`config`: an Fp8ExpertsConfig, an FP8_CANDIDATES name, or None ("auto"): fp8_choice's."""
    R = num_tokens * top_k
    choice = fp8_choice(num_tokens, top_k, num_experts, hidden, intermediate, device, config)
    cfg = choice.config
    rows = max_blocks(R, num_experts, cfg.block_m) * cfg.block_m
    return Fp8ExpertsWorkspace(
        cfg, (num_tokens, top_k, num_experts, hidden, intermediate),
        **alignment_buffers(R, num_experts, cfg.block_m, device),
        act_q=torch.empty(rows, intermediate, dtype=E4M3, device=device),
        act_scales=torch.empty(rows, intermediate // ACT_GROUP, dtype=torch.float32, device=device),
        y=torch.empty(R, hidden, dtype=torch.bfloat16, device=device), choice=choice)


def _programs(device: torch.device, max_tiles: int, block_m: int, cfg: Fp8GemmConfig, weight_tiles: int) -> int:
    """persistent_programs with fp8 tiles: it counts 2-byte elements, so the K extent it sees is halved."""
    bytes_view = types.SimpleNamespace(block_n=cfg.block_n, block_k=BLOCK_K // 2, num_stages=cfg.num_stages,
                                       num_warps=cfg.num_warps)
    return persistent_programs(device, max_tiles, block_m, bytes_view, weight_tiles)


def _gate_up(x_q, x_scales, w13_q, w13_scales, ws: Fp8ExpertsWorkspace, top_k: int, mode: int, group_steps: int,
             sorted_ids, expert_ids, num_post) -> None:
    cfg, bm = ws.config.gate_up, ws.config.block_m
    M, H = x_q.shape
    E, two_i, _ = w13_q.shape
    inter = two_i // 2
    assert cfg.block_n == ACT_GROUP, "gate/up BLOCK_N is the re-quantisation group"
    n_pid_m = max_blocks(M * top_k, E, bm)
    programs = _programs(x_q.device, n_pid_m * (inter // cfg.block_n), bm, cfg, 2)
    w_arg, tma = weight_operand(w13_q, cfg.block_n, cfg, inter)
    _fp8_gate_up_kernel[(programs,)](
        x_q, x_scales, w_arg, w13_scales, ws.act_q, ws.act_scales, sorted_ids, expert_ids, num_post,
        M * top_k, top_k, H, inter, programs,
        x_q.stride(0), x_scales.stride(0), w13_q.stride(0), w13_q.stride(1), w13_scales.stride(0),
        w13_scales.stride(1), ws.act_q.stride(0), ws.act_scales.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m, X_SCALE=mode,
        GROUP_STEPS=group_steps, WEIGHT_TMA=tma, UPCAST_DOT=interpreting(), SOFT_FP8=soft_fp8(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _down(w2_q, w2_scales, topk_weights, ws: Fp8ExpertsWorkspace, sorted_ids, expert_ids, num_post) -> None:
    cfg, bm = ws.config.down, ws.config.block_m
    E, H, inter = w2_q.shape
    R = topk_weights.numel()
    n_pid_m = max_blocks(R, E, bm)
    programs = _programs(w2_q.device, n_pid_m * (H // cfg.block_n), bm, cfg, 1)
    w_arg, tma = weight_operand(w2_q, cfg.block_n, cfg, H)
    _fp8_down_kernel[(programs,)](
        ws.act_q, ws.act_scales, w_arg, w2_scales, ws.y, topk_weights, sorted_ids, expert_ids, num_post,
        R, H, inter, programs,
        ws.act_q.stride(0), ws.act_scales.stride(0), w2_q.stride(0), w2_q.stride(1), w2_scales.stride(0),
        w2_scales.stride(1), ws.y.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m, WEIGHT_TMA=tma,
        UPCAST_DOT=interpreting(), SOFT_BF16=soft_bf16(ws.y), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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
    workspace = checked_workspace(workspace, (M, K, E, H, I),
                                  lambda: make_fp8_workspace(M, K, E, H, I, config=config, device=x_q.device))
    if config is not None and fp8_choice(M, K, E, H, I, x_q.device, config).config != workspace.config:
        raise ValueError("config differs from the workspace's (make the workspace with it)")
    ws = workspace
    x_q, x_scales, w13_q, w2_q = (t if t.is_contiguous() else t.contiguous() for t in (x_q, x_scales, w13_q, w2_q))
    w13_scales, w2_scales = w13_scales.contiguous(), w2_scales.contiguous()
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.float().contiguous()
    sorted_ids, expert_ids, num_post = routes_alignment(topk_ids, E, ws.config.block_m, ws, alignment)
    if K == 0:
        return out.zero_()
    fp8_expert_gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, ws,
                     (sorted_ids, expert_ids, num_post), top_k=K, group_size=group_size, scale_format=scale_format)
    return sum_slots(ws.y, topk_ids, E, out, block_h=ws.config.reduce_block_h)


def fp8_expert_gemms(x_q, x_scales, topk_weights, w13_q, w13_scales, w2_q, w2_scales, workspace: Fp8ExpertsWorkspace,
                     alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, top_k: int, group_size: int,
                     scale_format: str) -> torch.Tensor:
    """fused_experts_fp8's two grouped GEMMs without its slot sum, for a pipeline that times the reduction as a
    stage of its own: writes workspace.y (bf16 [M*K, H], the rows of placed routes only) and returns it. The
    operands as fused_experts_fp8 takes them (contiguous, topk_weights fp32); `alignment` built with the
    workspace config's block_m."""
    mode = x_scale_mode(group_size, scale_format)
    group_steps = max(1, group_size // BLOCK_K)
    sorted_ids, expert_ids, num_post = alignment
    _gate_up(x_q, x_scales, w13_q, w13_scales, workspace, top_k, mode, group_steps, sorted_ids, expert_ids,
             num_post)
    _down(w2_q, w2_scales, topk_weights, workspace, sorted_ids, expert_ids, num_post)
    return workspace.y
