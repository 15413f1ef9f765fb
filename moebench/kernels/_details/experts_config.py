"""Launch configurations of the grouped expert GEMMs (kernels.grouped_gemm), both precisions in one config type.

`ExpertsConfig.precision` says which kernels a config launches: "bf16" (bf16 operands, fp32 accumulation) or
"fp8_block" (e4m3 operands with 128x128 weight block scales and per-row-group activation scales, BLOCK_K fixed at
128 so each K step promotes its MMA result once; kernels.fused_experts_fp8). Each precision keeps its own tuned
kernel, candidate table, fitting and rule, registered here so `moebench tune` and the committed tables
(tuned/<GPU>.json) name them as before: "fused_experts" (EXPERTS_CANDIDATES) and "fused_experts_fp8"
(FP8_CANDIDATES), both bucketed T=next_pow2(tokens),K,E,H,I. `experts_choice(..., precision=)` is the one choice:
explicit > tuned table > rule, the named or tabled candidate fitted to the shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import triton

from moebench.kernels._details.jit import interpreting, next_pow2
from moebench.kernels._details.tuning import Choice, Tunable, choose, pow2_bucket, register_tunable

__all__ = ["BF16", "FP8_BLOCK", "PRECISIONS", "FP8_BLOCK_K", "GemmConfig", "ExpertsConfig", "Fp8GemmConfig",
           "Fp8ExpertsConfig", "EXPERTS_CANDIDATES", "FP8_CANDIDATES", "fit_config", "fit_fp8_config",
           "choose_config", "choose_fp8_config", "experts_choice", "operand_bytes", "fit_fp8_layout", "LAYOUT_FALLBACK"]

BF16, FP8_BLOCK = "bf16", "fp8_block"
PRECISIONS = (BF16, FP8_BLOCK)
FP8_BLOCK_K = 128  # fp8: one weight scale block (and, for group >= 128, one activation scale) per K step
_KERNEL = {BF16: "fused_experts", FP8_BLOCK: "fused_experts_fp8"}  # the tuned kernel of each precision


def operand_bytes(precision: str) -> int:
    """Bytes of one GEMM operand element (what a pipeline stage of shared memory holds)."""
    return 1 if precision == FP8_BLOCK else 2


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of one grouped GEMM (BLOCK_M is shared, see ExpertsConfig)."""

    block_n: int
    block_k: int
    group_m: int = 8  # M-blocks per swizzle group: programs sharing an N tile run together (weight reuse in L2)
    num_warps: int = 4
    num_stages: int = 3
    weight_tma: bool = False  # weight tiles through a TMA descriptor (where the layout allows), else cp.async
    # A tiles through a TMA descriptor too: down reads act's contiguous rows; gate/up reads x's rows staged in sorted
    # order (kernels.stage_rows) where its workspace has the buffer; unpaired launches only (one box row count)
    act_tma: bool = False
    # the persistent tile loop and the K loop fused into one software pipeline (tl.range(flatten=True)), so the
    # next tile's first loads are in flight during this tile's epilogue; unpaired launches only
    flatten: bool = False
    # the persistent tile loop warp-specialised by Triton (tl.range(warp_specialize=True)); unpaired launches only
    warp_specialize: bool = False
    # fp8 gate/up: each accumulator carried in units of the step's scale and rescaled before the MMA accumulates
    # in place (kernels.fused_experts_fp8's RESCALE), instead of the step's MMA result held beside it
    rescale: bool = False
    # bf16 gate/up: the tile's gate and up weight rows in one [1, 2, BLOCK_N, BLOCK_K] TMA box and one
    # [BLOCK_M, 2*BLOCK_N] MMA a K step (as one 256-wide tile where BLOCK_N is 128), split after the loop
    one_dot: bool = False

    def short(self, with_k: bool = True) -> str:
        return (f"N{self.block_n}" + (f"K{self.block_k}" if with_k else "")
                + f"w{self.num_warps}s{self.num_stages}g{self.group_m}" + ("tma" if self.weight_tma else "")
                + ("+a" if self.act_tma else "") + ("+f" if self.flatten else "")
                + ("+ws" if self.warp_specialize else "") + ("+r" if self.rescale else "")
                + ("+1dot" if self.one_dot else ""))


@dataclass(frozen=True)
class ExpertsConfig:
    block_m: int  # alignment block size: rows of one GEMM tile (paired: of a narrow one), all owned by one expert
    gate_up: GemmConfig  # block_n counts columns of *each* half (gate and up): the program computes 2*block_n
    down: GemmConfig
    reduce_block_h: int = 1024
    name: str = field(default="", compare=False)  # the candidate it came from (a label: launches compare equal)
    precision: str = BF16
    # bf16: full row tiles of two alignment blocks (2*block_m rows), an expert's odd last block on a block_m-row
    # tile (kernels.row_tiles): block_m's padding with 2*block_m's weight reuse per row
    paired: bool = False

    def __post_init__(self):
        # rescale is the fp8 gate/up promotion's: elsewhere it would be recorded ("+r") and do nothing
        if self.down.rescale or (self.gate_up.rescale and self.precision != FP8_BLOCK):
            raise ValueError("rescale is a knob of the fp8 gate/up GEMM only")
        if self.down.one_dot or (self.gate_up.one_dot and self.precision != BF16):
            raise ValueError("one_dot is a knob of the bf16 gate/up GEMM only")

    def short(self) -> str:
        g, d = self.gate_up, self.down
        if self.precision == BF16:
            return f"BM{self.block_m}{'x2' if self.paired else ''} up:{g.short()} down:{d.short()}"
        # fp8's BLOCK_K is always 128: left out (the records' config_detail as before the precisions merged)
        return f"{self.name + ' ' if self.name else ''}BM{self.block_m} up:{g.short(False)} down:{d.short(False)}"


def Fp8GemmConfig(block_n: int, group_m: int = 8, num_warps: int = 8, num_stages: int = 3,
                  weight_tma: bool = True, act_tma: bool = False, flatten: bool = False,
                  warp_specialize: bool = False, rescale: bool = False) -> GemmConfig:
    """An fp8 GEMM's config: BLOCK_K is the scale block; gate/up block_n 128 (one re-quantisation group)."""
    return GemmConfig(block_n, FP8_BLOCK_K, group_m, num_warps, num_stages, weight_tma, act_tma, flatten,
                      warp_specialize, rescale)


def Fp8ExpertsConfig(block_m: int, gate_up: GemmConfig, down: GemmConfig, reduce_block_h: int = 1024,
                     name: str = "") -> ExpertsConfig:
    return ExpertsConfig(block_m, gate_up, down, reduce_block_h, name=name, precision=FP8_BLOCK)


def _fit(block: int, dim: int) -> int:
    """Shrink a block to the (power-of-two padded) dimension; tl.dot needs >= 16."""
    return max(16, min(block, next_pow2(dim)))


# ---------------------------------------------------------------------------------------------------------------
# bf16: kernel "fused_experts"
# ---------------------------------------------------------------------------------------------------------------

# The candidate table of fused_experts (`config:` of a sweep, `moebench tune sweeps/tune_experts.yaml`): the rule's
# four tiers (choose_config) and their neighbours. Each is fitted to the shape (fit_config) before it is launched.
EXPERTS_CANDIDATES: dict[str, ExpertsConfig] = {c.name: c for c in (
    ExpertsConfig(16, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 128, 8, 4, 4), name="bm16"),
    ExpertsConfig(32, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4), name="bm32"),
    ExpertsConfig(64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4), name="bm64"),
    # Prefill: gate/up N128 K64 on 8 warps, 3 stages, weights through TMA; down N256 K64, TMA too (the faster one
    # where routes are skipped). BM128 pads each expert's last block further, but halves the weight re-reads per row.
    ExpertsConfig(128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True),
                  name="bm128_tma"),
    ExpertsConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(256, 64, 8, 8, 3), name="bm128"),
    ExpertsConfig(64, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True),
                  name="bm64_tma"),
    ExpertsConfig(32, GemmConfig(128, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4), name="bm32_n128"),
    # Paired (kernels.row_tiles): bm128_tma's tiles on 64-row alignment blocks, an expert's odd last block on a
    # 64-row tile; and bm64's tiles on 32-row blocks, for ~64-128 routes per expert. Candidates for `moebench
    # tune`, not the rule's: a 64-row tile streams the same weight tiles as a 128-row one, and the second inlined
    # tile body slows the full tiles, so they do not beat bm128_tma (docs/benchmarks.md#expert-gemms-bf16-and-fp8).
    ExpertsConfig(64, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True),
                  name="bm64x2_tma", paired=True),
    ExpertsConfig(32, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4), name="bm32x2", paired=True),
)}


def fit_config(cfg: ExpertsConfig, hidden: int, intermediate: int) -> ExpertsConfig:
    """A candidate shrunk to the shape: blocks to the (power-of-two padded) dims, the reduction's block too.
    (weight_operand falls back to pointer loads where the shrunk BLOCK_N no longer divides I / H.)"""
    up, down = cfg.gate_up, cfg.down
    up = dataclasses.replace(up, block_n=_fit(up.block_n, intermediate), block_k=_fit(up.block_k, hidden))
    down = dataclasses.replace(down, block_n=_fit(down.block_n, hidden), block_k=_fit(down.block_k, intermediate))
    return dataclasses.replace(cfg, gate_up=up, down=down, reduce_block_h=_fit(cfg.reduce_block_h, hidden))


def choose_config(num_routes: int, num_experts: int, hidden: int, intermediate: int) -> ExpertsConfig:
    """The rule (the config where the tuned table has no entry): deterministic from the shapes known on the host
    (num_routes = M*K, including skipped slots: the number of valid routes is only known on the device and reading
    it would break CUDA-graph capture).

    BLOCK_M follows the expected rows per expert, so the padding of each expert's last block wastes little:
    decode-sized batches are weight-bandwidth bound (small tiles, many programs); prefill-sized ones are compute
    bound (tiles large enough for Hopper's wgmma: 64 rows per warpgroup, 256 columns per program).
    """
    if interpreting():
        # The CPU interpreter's cost is per program and per op: small M blocks (little padding), whole-ish N/K.
        bm = 16
        return ExpertsConfig(bm, GemmConfig(_fit(32, intermediate), _fit(32, hidden), 4, 4, 1),
                             GemmConfig(_fit(64, hidden), _fit(32, intermediate), 4, 4, 1),
                             reduce_block_h=_fit(256, hidden), name="interp")
    rows_per_expert = num_routes / max(1, num_experts)
    if rows_per_expert <= 24:
        name = "bm16"
    elif rows_per_expert <= 48:
        name = "bm32"
    elif rows_per_expert < 128:
        name = "bm64"
    else:
        name = "bm128_tma"
    return fit_config(EXPERTS_CANDIDATES[name], hidden, intermediate)


# ---------------------------------------------------------------------------------------------------------------
# fp8 block-scaled: kernel "fused_experts_fp8"
# ---------------------------------------------------------------------------------------------------------------

# The candidate table (`config:` of a sweep, `moebench tune sweeps/tune_experts_fp8.yaml`): the rule's decode tiers
# and prefill-sized tiles (>= 128 routes per expert). Shared memory per stage of the BM64 ones: A BM x 128 B +
# weights (2x)BN x 128 B: 40 KiB (<= 4 stages fit). Register budget: see kernels.fused_experts_fp8's docstring.
FP8_CANDIDATES: dict[str, ExpertsConfig] = {c.name: c for c in (
    # decode: weight-bandwidth bound, mma.sync tiles, many programs
    Fp8ExpertsConfig(16, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4), name="bm16"),
    Fp8ExpertsConfig(32, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4), name="bm32"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 4), Fp8GemmConfig(256, 8, 8, 4), name="bm64_s4"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 3), Fp8GemmConfig(256, 8, 8, 3), name="bm64_s3"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 16, 8, 4), Fp8GemmConfig(128, 16, 4, 4), name="bm64_g16_down128"),
    Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 4, weight_tma=False), Fp8GemmConfig(256, 8, 8, 4, weight_tma=False),
                     name="bm64_s4_notma"),
    # 128-row tiles: twice the MMA work per weight tile streamed; the gate/up program's [128, 2*128] accumulator and
    # step result (256 fp32 a thread over 8 warps) spread over 16 warps (128 registers a thread, a few spilled)
    Fp8ExpertsConfig(128, Fp8GemmConfig(128, 8, 16, 4), Fp8GemmConfig(128, 8, 8, 4), name="bm128_w16_down128"),
    # the same 128-row gate/up tile on 8 warps (two warpgroups of 64 x 128 MMAs instead of four of 64 x 64) with its
    # accumulators rescaled in place (one fp32 copy: 128 registers a thread); down's act rows through TMA
    Fp8ExpertsConfig(128, Fp8GemmConfig(128, 8, 8, 3, rescale=True), Fp8GemmConfig(128, 8, 8, 4, act_tma=True),
                     name="bm128_w8r"),
    Fp8ExpertsConfig(128, Fp8GemmConfig(128, 8, 16, 3), Fp8GemmConfig(256, 8, 16, 3), name="bm128_w16"),
)}


def fit_fp8_config(cfg: ExpertsConfig, hidden: int) -> ExpertsConfig:
    """A candidate fitted to H: the down GEMM's BLOCK_N must divide it, the reduction's block at most next_pow2(H)."""
    if hidden % cfg.down.block_n:
        cfg = dataclasses.replace(cfg, down=dataclasses.replace(cfg.down, block_n=128))
    return dataclasses.replace(cfg, reduce_block_h=min(cfg.reduce_block_h, triton.next_power_of_2(hidden)))


def choose_fp8_config(num_routes: int, num_experts: int, hidden: int, intermediate: int) -> ExpertsConfig:
    """The rule (the config where the tuned table has no entry), deterministic from the host-known shapes (like
    `choose_config`): BM16 / BM32 / bm64_s4 / bm128_w8r by rows per expert (<= 24, <= 48, < 256, more: from 256
    rows per expert the 128-row tiles were the fastest on the H200; bm128_w8r's rescaled 8-warp gate/up kernel took
    9% less than bm128_w16_down128's 16 warps at 2048 rows per expert on an H100, docs/benchmarks.md; not measured
    between 256 and 2048)."""
    if interpreting():
        # the interpreter's cost is per program and op: small M blocks, whole-ish N
        return Fp8ExpertsConfig(16, Fp8GemmConfig(128, 4, 4, 1, weight_tma=False),
                                Fp8GemmConfig(128, 4, 4, 1, weight_tma=False),
                                reduce_block_h=min(1024, triton.next_power_of_2(hidden)), name="interp")
    rows_per_expert = num_routes / max(1, num_experts)
    name = ("bm16" if rows_per_expert <= 24 else "bm32" if rows_per_expert <= 48 else
            "bm64_s4" if rows_per_expert < 256 else "bm128_w8r")
    return fit_fp8_config(FP8_CANDIDATES[name], hidden)


# The launch for the group-32 ue8m0 activation scales (DeepSeek-V4 staging) where the table or the rule names a
# 128-row gate/up program: at 16 warps the per-element exponent alignment of that layout (fused_experts_fp8's X_SCALE
# 2) does not fit beside its 128 registers a thread (ptxas spills several times more than with fp32 scales), which
# slows the layer far below the 64-row tiles; the 8-warp rescaled tile holds as many accumulator registers, so it is
# refit too (not measured under that layout). The table is tuned on fp32 group-128 scales (tune_experts_fp8), where
# this candidate was the runner-up in every bucket the 16-warp tiles won.
LAYOUT_FALLBACK = "bm64_g16_down128"


def fit_fp8_layout(choice: Choice, hidden: int, group_size: int | None, scale_format: str | None) -> Choice:
    """`choice` (fp8) for the activation-scale layout it will launch on: a table or rule choice with a 128-row
    gate/up program becomes LAYOUT_FALLBACK (with a note) for group-32 ue8m0 scales; explicit choices, other layouts
    and an unknown layout (None) are left as they are."""
    cfg = choice.config
    if (choice.source == "explicit" or group_size != 32 or scale_format != "ue8m0_packed"
            or (cfg.gate_up.num_warps <= 8 and cfg.block_m < 128)):
        return choice
    fallback = fit_fp8_config(FP8_CANDIDATES[LAYOUT_FALLBACK], hidden)
    return dataclasses.replace(choice, name=LAYOUT_FALLBACK, config=fallback,
                               note=f"{choice.name} refit for ue8m0 group-32 activation scales")


# ---------------------------------------------------------------------------------------------------------------
# Registration and the one choice
# ---------------------------------------------------------------------------------------------------------------

_FIT = {BF16: fit_config, FP8_BLOCK: lambda cfg, hidden, intermediate: fit_fp8_config(cfg, hidden)}
_RULE = {BF16: choose_config, FP8_BLOCK: choose_fp8_config}


def _bucket(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int) -> str:
    return f"T={pow2_bucket(num_tokens)},K={top_k},E={num_experts},H={hidden},I={intermediate}"


def _rule_of(precision: str):
    # looked up at call time, so a test patching this module's `interpreting` reaches the rule
    def rule(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int):
        cfg = _RULE[precision](num_tokens * top_k, num_experts, hidden, intermediate)
        return cfg.name, cfg
    return rule


register_tunable(Tunable(
    "fused_experts", EXPERTS_CANDIDATES, _bucket, _rule_of(BF16),
    "choose_config: BM16 / 32 / 64 / 128+TMA by rows per expert (<= 24, <= 48, < 128, more); "
    "the interpreter: small tiles"))
register_tunable(Tunable(
    "fused_experts_fp8", FP8_CANDIDATES, _bucket, _rule_of(FP8_BLOCK),
    "choose_fp8_config: bm16 / bm32 / bm64_s4 / bm128_w8r by rows per expert (<= 24, <= 48, < 256, more); "
    "the interpreter: small tiles"))


def experts_choice(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, device=None,
                   config: str | ExpertsConfig | None = None, *, precision: str = BF16) -> Choice:
    """The launch config of the `precision` expert GEMMs on `device`: `config` (a candidate name of that precision's
    table, fitted to the shape, or an ExpertsConfig, launched as given), else the tuned table (bucket
    T=next_pow2(tokens),K,E,H,I; the candidate fitted to the shape), else the precision's rule."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if isinstance(config, ExpertsConfig) and config.precision != precision:
        raise ValueError(f"config is a {config.precision} config, the launch is {precision}")
    choice = choose(_KERNEL[precision], device, config, num_tokens=num_tokens, top_k=top_k, num_experts=num_experts,
                    hidden=hidden, intermediate=intermediate)
    if isinstance(config, ExpertsConfig) or choice.source == "rule":
        return choice
    return dataclasses.replace(choice, config=_FIT[precision](choice.config, hidden, intermediate))
