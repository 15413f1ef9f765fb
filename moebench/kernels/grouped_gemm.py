"""The pieces of `fused_experts`: route alignment, the two grouped GEMMs and the slot reduction.

Data flow (E local experts, R = M*K flat routes, route index i = token*K + k):
  align_routes      topk_ids -> sorted_ids (routes grouped by expert, each expert's segment padded to a multiple
                    of BLOCK_M with the pad value R), expert_ids (owner of each BLOCK_M block), num_post_padded.
                    This is the contract's moe_align_block_size (without expert_map; its Triton kernels do the work);
                    skipped routes (id < 0 or id >= E) are never placed, so no later kernel sees them.
  gate_up_swiglu    act[j] = silu(x[tok] @ w13[e, :I].T) * (x[tok] @ w13[e, I:].T) for sorted position j;
                    both halves in one program so the SwiGLU is an epilogue. Rows of act are sorted positions.
  down_proj         y[i] = topk_weight[i] * (act[j] @ w2[e].T), written at the route's own row i.
  sum_slots         out[m] = sum over valid k of y[m*K + k] (fp32, k ascending); invalid slots never loaded
                    (masked_moe_sum's kernel, with ids >= E skipped too).
The GEMM kernels are persistent: a fixed number of programs (what fits on the GPU) walk the tiles of the blocks
that exist, num_post_padded being read on the device, so skipped routes cost no GEMM work, no program launch, and
nothing synchronises with the host (CUDA-graph capturable).

Each GEMM kernel has a plain-torch reference `<name>_torch` below it; the alignment's reference is
moe_align_block_size_torch. The layer runs these stages one by one (moebench.bench.layer); fused_experts chains them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from moebench.kernels._details.align_config import align_workspace_size
from moebench.kernels._details.jit import check_triton_device, interpreting, next_pow2
from moebench.kernels._details.rounding import round_store_value, soft_bf16
from moebench.kernels._details.tuning import Choice, Tunable, choose, pow2_bucket, register_tunable
from moebench.kernels.masked_moe_sum import launch_masked_sum, sum_launch_config
from moebench.kernels.moe_align_block_size import align_capacity, moe_align_block_size

# ---------------------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of one grouped GEMM (BLOCK_M is shared, see ExpertsConfig)."""

    block_n: int
    block_k: int
    group_m: int = 8  # M-blocks per swizzle group: programs sharing an N tile run together (weight reuse in L2)
    num_warps: int = 4
    num_stages: int = 3
    weight_tma: bool = False  # weight tiles through a TMA descriptor (where the layout allows), else cp.async

    def short(self) -> str:
        return (f"N{self.block_n}K{self.block_k}w{self.num_warps}s{self.num_stages}g{self.group_m}"
                + ("tma" if self.weight_tma else ""))


@dataclass(frozen=True)
class ExpertsConfig:
    block_m: int  # alignment block size: rows of one GEMM program, all owned by one expert
    gate_up: GemmConfig  # block_n counts columns of *each* half (gate and up): the program computes 2*block_n
    down: GemmConfig
    reduce_block_h: int = 1024
    name: str = field(default="", compare=False)  # the candidate it came from (a label: launches compare equal)

    def short(self) -> str:
        g, d = self.gate_up, self.down
        return f"BM{self.block_m} up:{g.short()} down:{d.short()}"


def _fit(block: int, dim: int) -> int:
    """Shrink a block to the (power-of-two padded) dimension; tl.dot needs >= 16."""
    return max(16, min(block, next_pow2(dim)))


# The candidate table of fused_experts (`config:` of a sweep, `moebench tune sweeps/tune_experts.yaml`): the rule's
# four tiers (choose_config) and their neighbours. Each is fitted to the shape (fit_config) before it is launched.
EXPERTS_CANDIDATES: dict[str, ExpertsConfig] = {c.name: c for c in (
    ExpertsConfig(16, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 128, 8, 4, 4), name="bm16"),
    ExpertsConfig(32, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4), name="bm32"),
    ExpertsConfig(64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4), name="bm64"),
    # Measured on an H200 (128 experts, 4096 tokens x top-8, H=7168, I=2048; us at 0% / 50% of routes
    # skipped): gate/up N128 K64 w8 s3 with TMA weights 4036 / 2821 (BM64's default 5198 at 0%), down N256 K64
    # w8 s3 2113 / 1495 plain, 2158 / 1453 with TMA. TMA for down: the faster one where routes are skipped.
    # BM128 pads each expert's last block further, but halves the weight re-reads per row.
    ExpertsConfig(128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True),
                  name="bm128_tma"),
    ExpertsConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(256, 64, 8, 8, 3), name="bm128"),
    ExpertsConfig(64, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True),
                  name="bm64_tma"),
    ExpertsConfig(32, GemmConfig(128, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4), name="bm32_n128"),
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


def _experts_rule(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int):
    cfg = choose_config(num_tokens * top_k, num_experts, hidden, intermediate)
    return cfg.name, cfg


register_tunable(Tunable(
    "fused_experts", EXPERTS_CANDIDATES,
    lambda num_tokens, top_k, num_experts, hidden, intermediate:
        f"T={pow2_bucket(num_tokens)},K={top_k},E={num_experts},H={hidden},I={intermediate}",
    _experts_rule, "choose_config: BM16 / 32 / 64 / 128+TMA by rows per expert (<= 24, <= 48, < 128, more); "
                   "the interpreter: small tiles"))


def experts_choice(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, device=None,
                   config: str | ExpertsConfig | None = None) -> Choice:
    """fused_experts' launch config on `device`: `config` (an EXPERTS_CANDIDATES name or an ExpertsConfig, launched
    as given), else the tuned table (bucket T=next_pow2(tokens),K,E,H,I; the candidate fitted to the shape), else
    choose_config."""
    choice = choose("fused_experts", device, config, num_tokens=num_tokens, top_k=top_k, num_experts=num_experts,
                    hidden=hidden, intermediate=intermediate)
    if isinstance(config, ExpertsConfig) or choice.source == "rule":
        return choice
    return dataclasses.replace(choice, config=fit_config(choice.config, hidden, intermediate))


def max_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the blocks alignment can produce: sum_e ceil(c_e / BM) < R/BM + #non-empty experts."""
    return min(align_capacity(num_routes, num_experts, block_m)[1],
               triton.cdiv(num_routes, block_m) + min(num_experts, num_routes))


# ---------------------------------------------------------------------------------------------------------------
# Alignment: moe_align_block_size (its count / scan / scatter kernels), without an expert map
# ---------------------------------------------------------------------------------------------------------------

def align_scratch_size(num_routes: int, num_experts: int, device=None) -> int:
    """int32 elements of the alignment scratch: moe_align_block_size's workspace under the align config it chooses
    on `device` (kernels._details.align_config.align_choice; None: the current GPU, or the interpreter)."""
    return align_workspace_size(num_routes, num_experts, device=device)


def align_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [cap], expert_ids int32 [cap/BM], num_post_padded int32 [1]); see the module docstring.

    `out` = (sorted_ids, expert_ids, num_post_padded, scratch) preallocated, for timed runs; scratch is int32 with
    at least align_scratch_size(M*K, E) elements (its contents need no initialisation).
    """
    check_triton_device(topk_ids)
    ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int32)
    if out is None:
        return moe_align_block_size(ids, num_experts, block_m)
    sorted_ids, expert_ids, num_post, scratch = out
    need = align_scratch_size(ids.numel(), num_experts, ids.device)
    if scratch.dtype != torch.int32 or scratch.numel() < need:
        raise ValueError(f"alignment scratch: need int32 with >= {need} elements (align_scratch_size), got "
                         f"{scratch.dtype} with {scratch.numel()}")
    return moe_align_block_size(ids, num_experts, block_m, out=(sorted_ids, expert_ids, num_post),
                                workspace=scratch[:need])


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMMs
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M consecutive M-blocks sweep the N tiles together, so the weight tile of an
    expert (whose blocks are consecutive) and the activation rows of the group are re-read from L2, not HBM."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_swiglu_kernel(x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                           num_routes, top_k, hidden, inter, num_programs,
                           stride_xm, stride_we, stride_wn, stride_am,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                           UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Persistent: program p takes tiles p, p + num_programs, ... of the blocks that exist (num_post_padded is
    read on the device), so skipped routes cost no program at all.
    w13: a pointer to [E, 2I, H], or (WEIGHT_TMA) a TMA descriptor over its [E*2I, H] view with
    [BLOCK_N, BLOCK_K] boxes (then I % BLOCK_N == 0, so a box never crosses the gate/up or expert boundary)."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(inter, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        route = tl.load(sorted_ptr + offs_m)
        row_ok = route < num_routes  # pad entries of the expert's last block
        token = (route // top_k).to(tl.int64)
        # columns wrap modulo I so loads need no N mask (the store masks them); gate rows n, up rows I + n
        offs_n_store = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = offs_n_store % inter
        x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
        if WEIGHT_TMA:
            gate_row = (expert * 2 * inter + pid_n * BLOCK_N).to(tl.int32)
        else:
            g_ptrs = w13 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
            u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < hidden - kb * BLOCK_K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if WEIGHT_TMA:  # out-of-range columns (a K tail) are zero-filled by the TMA unit
                g = tl.trans(w13.load([gate_row, kb * BLOCK_K]))
                u = tl.trans(w13.load([gate_row + inter, kb * BLOCK_K]))
            elif EVEN_K:
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact here
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            x_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n_store[None, :]
        tl.store(a_ptrs, round_store_value(act, act_ptr.dtype.element_ty, SOFT_BF16),
                 mask=(offs_n_store < inter)[None, :])


@triton.jit
def _down_proj_kernel(act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                      num_routes, hidden, inter, num_programs,
                      stride_am, stride_we, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                      UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Persistent like the gate/up kernel. w2: a pointer to [E, H, I], or (WEIGHT_TMA) a descriptor over its
    [E*H, I] view (H % BLOCK_N == 0)."""
    num_pid_m = tl.load(num_post_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        route = tl.load(sorted_ptr + offs_m)
        row_ok = route < num_routes
        offs_n_store = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = offs_n_store % hidden
        # act rows are sorted positions: a block's rows are contiguous, every one written by the gate/up kernel
        a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        if WEIGHT_TMA:
            w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        else:
            w_ptrs = w2 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(inter, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                k_ok = offs_k < inter - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            if WEIGHT_TMA:
                w = tl.trans(w2.load([w_row, kb * BLOCK_K]))
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            if not WEIGHT_TMA:
                w_ptrs += BLOCK_K
        weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        y_ptrs = y_ptr + route.to(tl.int64)[:, None] * stride_ym + offs_n_store[None, :]
        tl.store(y_ptrs, round_store_value(acc, y_ptr.dtype.element_ty, SOFT_BF16),
                 mask=row_ok[:, None] & (offs_n_store < hidden)[None, :])


_SM_COUNT: dict[int, int] = {}


def persistent_programs(device: torch.device, max_tiles: int, block_m: int, cfg: "GemmConfig",
                        weight_tiles: int) -> int:
    """Programs of a persistent GEMM launch: as many as fit on the GPU at once (from a shared-memory estimate of
    the pipeline buffers: an A tile and `weight_tiles` weight tiles each), never more than tiles can exist.
    Erring high only queues programs behind others (same total time); erring low would idle SMs."""
    if device.type != "cuda":
        sms = 2  # the interpreter: a few programs, so each one walks several tiles
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _SM_COUNT[idx]
    stage_bytes = (block_m + weight_tiles * cfg.block_n) * cfg.block_k * 2
    # Hopper's wgmma path (64+ rows, whole warpgroups) keeps num_stages buffers, the mma.sync path one fewer
    buffers = cfg.num_stages if block_m >= 64 and cfg.num_warps % 4 == 0 else cfg.num_stages - 1
    per_sm = max(1, min(4, (227 * 1024) // max(1, buffers * stage_bytes)))
    return max(1, min(max_tiles, sms * per_sm))


def weight_operand(w: torch.Tensor, rows_per_box: int, cfg: "GemmConfig", tile_dim: int):
    """(kernel argument, uses TMA): a TMA descriptor over w's [E*rows, K] view when the config asks for it and the
    layout allows it (contiguous, 16-byte rows, BLOCK_N dividing the per-expert tile dimension), else w itself."""
    if not cfg.weight_tma:
        return w, False
    ok = (w.is_contiguous() and (w.shape[-1] * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0
          and tile_dim % cfg.block_n == 0 and w.shape[0] * w.shape[1] < 2**31)
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - triton without host-side descriptors
        ok = False
    if not ok:
        return w, False
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), block_shape=[rows_per_box, cfg.block_k]), True


def gate_up_swiglu(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                   num_post: torch.Tensor, top_k: int, block_m: int, cfg: GemmConfig, act: torch.Tensor
                   ) -> torch.Tensor:
    """act[j, :] for every sorted position j < num_post (rows of pad entries are zeros)."""
    M, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    num_routes = M * top_k
    num_pid_m = max_blocks(num_routes, E, block_m)
    if num_routes == 0 or num_pid_m == 0:
        return act
    assert act.shape[0] >= num_pid_m * block_m and act.shape[1] == inter and act.stride(1) == 1
    programs = persistent_programs(x.device, num_pid_m * triton.cdiv(inter, cfg.block_n), block_m, cfg, 2)
    w_arg, tma = weight_operand(w13, cfg.block_n, cfg, inter)
    _gate_up_swiglu_kernel[(programs,)](
        x, w_arg, act, sorted_ids, expert_ids, num_post, num_routes, top_k, H, inter, programs,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=H % cfg.block_k == 0, WEIGHT_TMA=tma, UPCAST_DOT=interpreting(), SOFT_BF16=soft_bf16(act),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return act


def down_proj(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
              expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int, cfg: GemmConfig, y: torch.Tensor
              ) -> torch.Tensor:
    """y[i, :] = topk_weights.flat[i] * act[j] @ w2[e].T for each placed route i (sorted position j); the rows of
    skipped routes are not written."""
    E, H, inter = w2.shape
    num_routes = topk_weights.numel()
    num_pid_m = max_blocks(num_routes, E, block_m)
    if num_routes == 0 or num_pid_m == 0:
        return y
    assert y.shape == (num_routes, H) and y.stride(1) == 1 and topk_weights.is_contiguous()
    programs = persistent_programs(act.device, num_pid_m * triton.cdiv(H, cfg.block_n), block_m, cfg, 1)
    w_arg, tma = weight_operand(w2, cfg.block_n, cfg, H)
    _down_proj_kernel[(programs,)](
        act, w_arg, y, topk_weights, sorted_ids, expert_ids, num_post, num_routes, H, inter, programs,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, WEIGHT_TMA=tma, UPCAST_DOT=interpreting(), SOFT_BF16=soft_bf16(y),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def gate_up_swiglu_torch(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                         num_post: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """Reference of gate_up_swiglu in fp32: [num_post, I] fp32 (pad rows zero)."""
    n = int(num_post.item())
    inter = w13.shape[1] // 2
    num_routes = x.shape[0] * top_k
    act = torch.zeros(n, inter, dtype=torch.float32, device=x.device)
    for b in range(n // block_m):
        e = int(expert_ids[b])
        rows = sorted_ids[b * block_m:(b + 1) * block_m].long()
        ok = rows < num_routes
        h = x[rows[ok] // top_k].float() @ w13[e].float().T
        act[b * block_m:(b + 1) * block_m][ok] = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return act


def down_proj_torch(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int) -> torch.Tensor:
    """Reference of down_proj in fp32: [R, H] fp32, NaN in the rows of skipped routes (never written)."""
    num_routes = topk_weights.numel()
    H = w2.shape[1]
    y = torch.full((num_routes, H), float("nan"), dtype=torch.float32, device=act.device)
    flat_w = topk_weights.reshape(-1).float()
    for b in range(int(num_post.item()) // block_m):
        e = int(expert_ids[b])
        rows = sorted_ids[b * block_m:(b + 1) * block_m].long()
        ok = rows < num_routes
        pos = torch.arange(b * block_m, (b + 1) * block_m, device=act.device)[ok]
        y[rows[ok]] = (act[pos].float() @ w2[e].float().T) * flat_w[rows[ok]][:, None]
    return y


# ---------------------------------------------------------------------------------------------------------------
# Slot reduction (deterministic: fp32, k ascending, no atomics)
# ---------------------------------------------------------------------------------------------------------------

def sum_slots(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor,
              block_h: int = 1024) -> torch.Tensor:
    """out[m] = sum over k with 0 <= topk_ids[m,k] < num_experts of y[m*K + k] (fp32 in order k, rounded once).
    The rows of skipped slots are never loaded (they were never written). masked_moe_sum's kernel: two rows per
    program, all slot loads of a row block in flight together, padded row blocks store zeros only."""
    M, K = topk_ids.shape
    H = out.shape[1]
    if M == 0:
        return out
    if K == 0:
        return out.zero_()
    assert y.shape == (M * K, H) and y.stride(1) == 1 and out.stride(1) == 1
    ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int32)
    launch_masked_sum(y, (K * y.stride(0), y.stride(0)), ids, out, num_experts=num_experts,
                      launch=sum_launch_config(H, block_h, top_k=K))
    return out


def sum_slots_torch(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out_dtype: torch.dtype
                    ) -> torch.Tensor:
    M, K = topk_ids.shape
    y3 = y.reshape(M, K, -1)
    acc = torch.zeros(M, y3.shape[2], dtype=torch.float32, device=y.device)
    for k in range(K):
        ok = (topk_ids[:, k] >= 0) & (topk_ids[:, k] < num_experts)
        acc[ok] += y3[ok, k].float()
    return acc.to(out_dtype)
