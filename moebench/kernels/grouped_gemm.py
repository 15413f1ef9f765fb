"""The grouped-GEMM launcher of the expert computation, both precisions (bf16 | fp8 block-scaled).

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
nothing synchronises with the host (CUDA-graph capturable). A tile is one BLOCK_M block, or, for a paired config
(bf16), two: full tiles of 2*BLOCK_M rows and an expert's odd last block on a BLOCK_M-row tile, listed by
row_tile_map (kernels.row_tiles) on the device, so an expert's partial tile costs the narrower tile's rows while its
full tiles keep the wider tile's weight reuse.

What both precisions share lives here, once: the config (`ExpertsConfig.precision`, kernels._details.experts_config:
tables, rules, `experts_choice`), the alignment, the workspace (`make_workspace(precision=)`), the operand checks,
the tile start every kernel begins a tile with (`swizzle`, `tile_rows`, and `tile_prologue` = both for the
one-block-a-tile kernels: @triton.jit helpers Triton inlines), the
persistent-program sizing and the launch (`launch_persistent`). The kernels differ only in their K loop and
epilogue: the bf16 ones (gate_up_swiglu, down_proj and their plain-torch references) in kernels.grouped_gemm_bf16,
the fp8 ones (scale promotion, re-quantisation) in kernels.fused_experts_fp8. The alignment's reference is
moe_align_block_size_torch. The layer runs these stages one by one (moebench.bench.layer); fused_experts chains them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from moebench.kernels._details.align_config import align_workspace_size
from moebench.kernels._details.experts_config import (BF16, EXPERTS_CANDIDATES, FP8_BLOCK, ExpertsConfig, GemmConfig,
                                                      choose_config, experts_choice, fit_config, operand_bytes)
from moebench.kernels._details.jit import check_triton_device, interpreting
from moebench.kernels._details.tuning import Choice
from moebench.kernels.fp8_quant import ACT_GROUP, E4M3
from moebench.kernels.masked_moe_sum import sum_slots, sum_slots_torch
from moebench.kernels.moe_align_block_size import align_capacity, moe_align_block_size
from moebench.kernels.row_tiles import row_tile_buffers, row_tile_map
from moebench.kernels.stage_rows import stage_rows

__all__ = ["BF16", "FP8_BLOCK", "GemmConfig", "ExpertsConfig", "EXPERTS_CANDIDATES", "choose_config", "fit_config",
           "experts_choice", "max_blocks", "align_scratch_size", "align_routes", "alignment_buffers",
           "routes_alignment", "launch_tiles", "ExpertsWorkspace", "make_workspace", "checked_workspace",
           "launch_config",
           "check_routes", "expert_operand_shapes", "swizzle", "tile_rows", "tile_prologue",
           "persistent_programs",
           "tma_ready", "weight_operand", "staging_buffer", "gate_up_rows", "launch_persistent", "sum_slots",
           "sum_slots_torch"]


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

def alignment_buffers(num_routes: int, num_experts: int, block_m: int,
                      device: torch.device | str) -> dict[str, torch.Tensor]:
    """A workspace's alignment outputs and scratch (int32): sorted_ids, expert_ids, num_post, align_scratch."""
    cap, bcap = align_capacity(num_routes, num_experts, block_m)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(sorted_ids=torch.empty(cap, **i32), expert_ids=torch.empty(bcap, **i32),
                num_post=torch.empty(1, **i32),
                align_scratch=torch.empty(align_scratch_size(num_routes, num_experts, device), **i32))


def routes_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int, workspace,
                     alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_post): topk_ids aligned into the workspace's buffers, or the caller's
    `alignment` once its capacities are checked for block_m."""
    if alignment is None:
        ws = workspace
        return align_routes(topk_ids, num_experts, block_m,
                            out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch))
    sorted_ids, expert_ids, num_post = alignment
    cap, bcap = align_capacity(topk_ids.numel(), num_experts, block_m)
    if sorted_ids.numel() < cap or expert_ids.numel() < bcap:
        raise ValueError(f"alignment: expected capacities >= ({cap}, {bcap}) for block_m={block_m}, got "
                         f"({sorted_ids.numel()}, {expert_ids.numel()})")
    return sorted_ids, expert_ids, num_post


def launch_tiles(cfg: ExpertsConfig, expert_ids: torch.Tensor, num_post: torch.Tensor,
                 buffers: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GEMMs' `tiles` argument for config `cfg`: a paired config's row tile map built into `buffers`
    (row_tile_buffers of the alignment's block capacity) from this alignment, else None (one block a tile). An
    alignment with a larger expert_ids buffer is read up to the map's size: the blocks that exist fit in it."""
    if not cfg.paired:
        return None
    if buffers is None:
        raise ValueError("a paired config needs row tile buffers (row_tile_buffers)")
    return row_tile_map(expert_ids[: buffers[0].numel()], num_post, cfg.block_m, out=buffers)


# ---------------------------------------------------------------------------------------------------------------
# Workspace and argument checks (both precisions)
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class ExpertsWorkspace:
    """Everything the expert GEMMs write besides `out`, preallocated so a timed call allocates nothing."""

    config: ExpertsConfig
    num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    intermediate: int
    sorted_ids: torch.Tensor  # int32 [R + E*(BM-1)]
    expert_ids: torch.Tensor  # int32 [cdiv(that, BM)]
    num_post: torch.Tensor  # int32 [1]
    align_scratch: torch.Tensor  # int32 [align_scratch_size(R, E)]: moe_align_block_size's workspace
    act: torch.Tensor  # [max_blocks*BM, I] SwiGLU output per sorted position (fp8_block: re-quantised, e4m3)
    y: torch.Tensor  # [R, H] weighted expert output per route (fp8_block: bf16)
    choice: Any = None  # the tuning.Choice `config` came from (name, explicit | table | rule), for the records
    act_scales: torch.Tensor | None = None  # fp8_block: fp32 [max_blocks*BM, I/128], one per 128 columns of act
    tile_map: torch.Tensor | None = None  # paired configs: row_tile_map's int32 [block capacity] and counts [5]
    num_tiles: torch.Tensor | None = None
    x_rows: torch.Tensor | None = None  # gate_up.act_tma: x's rows staged in sorted order [max_blocks*BM, H]

    @property
    def tiles(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tile_map, num_tiles) of a paired workspace, else None."""
        return None if self.tile_map is None else (self.tile_map, self.num_tiles)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.num_tokens, self.top_k, self.num_experts, self.hidden, self.intermediate

    def fits(self, M: int, K: int, E: int, H: int, I: int) -> bool:
        return self.shape == (M, K, E, H, I)


def make_workspace(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, *,
                   config: ExpertsConfig | str | None = None, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cuda", precision: str = BF16) -> ExpertsWorkspace:
    """`config`: an ExpertsConfig, a candidate name of the precision's table, or None ("auto"): the tuned table,
    else the rule (experts_choice), or a Choice already made; the workspace keeps the choice. `dtype`: act and y of bf16 (fp8_block: e4m3 act
    with fp32 scales, bf16 y)."""
    R = num_tokens * top_k
    if isinstance(config, Choice):  # already chosen (fp8_choice: fitted to the activation-scale layout)
        if config.config.precision != precision:
            raise ValueError(f"config is a {config.config.precision} choice, the workspace is {precision}")
        choice = config
    else:
        choice = experts_choice(num_tokens, top_k, num_experts, hidden, intermediate, device, config,
                                precision=precision)
    cfg = choice.config
    blocks = max_blocks(R, num_experts, cfg.block_m)
    rows = blocks * cfg.block_m
    fp8 = precision == FP8_BLOCK
    if cfg.paired and fp8:
        raise ValueError("paired row tiles are a bf16 launch; fp8 configs are unpaired")
    # the tile map holds one entry per alignment block the buffers can hold (>= any launch's tiles)
    tile_map, num_tiles = (row_tile_buffers(align_capacity(R, num_experts, cfg.block_m)[1], device) if cfg.paired
                           else (None, None))
    return ExpertsWorkspace(
        cfg, num_tokens, top_k, num_experts, hidden, intermediate,
        **alignment_buffers(R, num_experts, cfg.block_m, device),
        act=torch.empty(rows, intermediate, dtype=E4M3 if fp8 else dtype, device=device),
        y=torch.empty(R, hidden, dtype=torch.bfloat16 if fp8 else dtype, device=device), choice=choice,
        act_scales=torch.empty(rows, intermediate // ACT_GROUP, dtype=torch.float32, device=device) if fp8 else None,
        tile_map=tile_map, num_tiles=num_tiles,
        x_rows=staging_buffer(cfg.gate_up, cfg.paired, rows, hidden, E4M3 if fp8 else dtype, device))


def checked_workspace(workspace, shape: tuple[int, int, int, int, int], make):
    """`workspace` if it fits shape (M, K, E, H, I), make() when it is None, else ValueError."""
    if workspace is None:
        return make()
    if not workspace.fits(*shape):
        raise ValueError("workspace was made for other shapes")
    return workspace


def launch_config(workspace: ExpertsWorkspace, config: ExpertsConfig | str | None, device,
                  precision: str = BF16) -> ExpertsConfig:
    """The config a `precision` call launches: the workspace's, or `config` (chosen like make_workspace's) when
    given; its BLOCK_M sizes the workspace's buffers, so it must be the workspace's."""
    if workspace.config.precision != precision:
        raise ValueError(f"workspace was made for {workspace.config.precision} experts, the call is {precision}")
    if config is None:
        return workspace.config
    cfg = experts_choice(*workspace.shape, device, config, precision=precision).config
    if cfg.block_m != workspace.config.block_m:
        raise ValueError("config.block_m differs from the workspace's")
    if cfg.paired and workspace.tile_map is None:
        raise ValueError("a paired config needs a workspace made for one (its row tile map)")
    return cfg


def check_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_tokens: int) -> int:
    """K of topk_ids [M, K] with topk_weights of its shape, or ValueError naming the inconsistent argument."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected [M={num_tokens}, K], got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    return topk_ids.shape[1]


def expert_operand_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, names=("x", "w13", "w2"),
                          dtype: torch.dtype | None = None, multiple: int = 1) -> tuple[int, int, int, int]:
    """(M, E, H, I) of x [M, H], w13 [E, 2I, H], w2 [E, H, I] (each of `dtype` when given; H and I multiples of
    `multiple`), or ValueError naming the inconsistent argument."""
    def bad(i: int, want: str, t: torch.Tensor) -> ValueError:
        if dtype is None:
            return ValueError(f"{names[i]}: expected {want}, got shape {tuple(t.shape)}")
        return ValueError(f"{names[i]}: expected {str(dtype).removeprefix('torch.float8_')} {want}, got {t.dtype} "
                          f"{tuple(t.shape)}")

    if x.dim() != 2 or (dtype is not None and x.dtype != dtype):
        raise bad(0, "[M, H]", x)
    M, H = x.shape
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2 or (dtype is not None and w13.dtype != dtype):
        raise bad(1, f"[E, 2I, H={H}]", w13)
    E, I = w13.shape[0], w13.shape[1] // 2
    if H % multiple or I % multiple:
        raise ValueError(f"hidden ({H}) and intermediate ({I}) must be multiples of {multiple}")
    if tuple(w2.shape) != (E, H, I) or (dtype is not None and w2.dtype != dtype):
        raise bad(2, f"[E={E}, H={H}, I={I}]", w2)
    return M, E, H, I


# ---------------------------------------------------------------------------------------------------------------
# The persistent launch (both precisions)
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
def tile_rows(first_row, sorted_ptr, expert_ids_ptr, num_routes, BLOCK_M: tl.constexpr, ALIGN_M: tl.constexpr):
    """A tile's expert (int64, the owner of its first ALIGN_M-row alignment block), its BLOCK_M sorted positions
    from first_row, the route at each and row_ok (False for the pad entries of an expert's last block)."""
    expert = tl.load(expert_ids_ptr + first_row // ALIGN_M).to(tl.int64)
    offs_m = first_row + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ptr + offs_m)
    row_ok = route < num_routes
    return expert, offs_m, route, row_ok


@triton.jit
def tile_prologue(tile, num_pid_m, num_pid_n, sorted_ptr, expert_ids_ptr, num_routes,
                  BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile -> (pid_n, first sorted position, expert (int64), offs_m: its BLOCK_M sorted positions, route at each,
    row_ok): the start of every tile of an unpaired fp8 grouped-GEMM kernel (one alignment block a tile)."""
    pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
    first_row = pid_m * BLOCK_M
    expert, offs_m, route, row_ok = tile_rows(first_row, sorted_ptr, expert_ids_ptr, num_routes, BLOCK_M, BLOCK_M)
    return pid_n, first_row, expert, offs_m, route, row_ok


_SM_COUNT: dict[int, int] = {}


def persistent_programs(device: torch.device, max_tiles: int, block_m: int, cfg: GemmConfig,
                        weight_tiles: int, elem_bytes: int = 2) -> int:
    """Programs of a persistent GEMM launch: as many as fit on the GPU at once (from a shared-memory estimate of
    the pipeline buffers: an A tile and `weight_tiles` weight tiles each, of `elem_bytes` operands), never more
    than tiles can exist. Erring high only queues programs behind others (same total time); erring low would idle
    SMs."""
    if device.type != "cuda":
        sms = 2  # the interpreter: a few programs, so each one walks several tiles
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _SM_COUNT[idx]
    stage_bytes = (block_m + weight_tiles * cfg.block_n) * cfg.block_k * elem_bytes
    # Hopper's wgmma path (64+ rows, whole warpgroups) keeps num_stages buffers, the mma.sync path one fewer
    buffers = cfg.num_stages if block_m >= 64 and cfg.num_warps % 4 == 0 else cfg.num_stages - 1
    per_sm = max(1, min(4, (227 * 1024) // max(1, buffers * stage_bytes)))
    return max(1, min(max_tiles, sms * per_sm))


_HOST_DESCRIPTORS = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover t's [rows, last dim] view: contiguous, 16-byte aligned rows, a row count
    within int32, and a Triton with host-side descriptors."""
    if not _HOST_DESCRIPTORS:  # pragma: no cover
        return False
    rows = t.numel() // max(1, t.shape[-1])
    return (t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
            and rows < 2**31)


def _descriptor(t: torch.Tensor, box: list[int], ok: bool, shape: tuple[int, ...] | None = None):
    """(kernel argument, uses TMA): a TMA descriptor with `box` boxes over t viewed as `shape` (default its [rows,
    last dim] view) where `ok` and the layout allow it (tma_ready), else t itself."""
    if not (ok and tma_ready(t)):
        return t, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.view(shape or (-1, t.shape[-1])), block_shape=box), True


def staging_buffer(gate_up: GemmConfig, paired: bool, rows: int, hidden: int, dtype: torch.dtype,
                   device) -> torch.Tensor | None:
    """The staged-rows buffer a gate/up launch of `gate_up` reads through TMA (kernels.stage_rows): [rows, H] of
    x's dtype where gate_up.act_tma asks and the launch is unpaired, else None (A rows gathered by token)."""
    if not gate_up.act_tma or paired:
        return None
    return torch.empty(rows, hidden, dtype=dtype, device=device)


def gate_up_rows(gate_up: GemmConfig, x: torch.Tensor, sorted_ids: torch.Tensor, num_post: torch.Tensor,
                 top_k: int, x_rows: torch.Tensor | None, paired: bool) -> dict:
    """The gate/up kernels' A arguments: with a staging buffer (staging_buffer) that TMA can read, x's rows are
    staged into it in sorted order and passed as launch_persistent's `act` (a [BLOCK_M, BLOCK_K]-box descriptor,
    ACT_TMA); otherwise x itself, gathered by token in the kernel (ACT_TMA False)."""
    if gate_up.act_tma and not paired and x_rows is not None and tma_ready(x_rows) and x.shape[0] > 0:
        stage_rows(x, sorted_ids, num_post, top_k, x_rows)
        return dict(act=("x_ptr", x_rows))
    return dict(x_ptr=x, ACT_TMA=False)


def weight_operand(w: torch.Tensor, rows_per_box: int, cfg: "GemmConfig", tile_dim: int, one_dot: bool = False):
    """(kernel argument, uses TMA): a TMA descriptor over w's [E*rows, K] view when the config asks for it and the
    layout allows it (contiguous, 16-byte rows, BLOCK_N dividing the per-expert tile dimension), else w itself.
    `one_dot` (gate/up's w13 [E, 2I, H]): over its [E, 2, I, H] view with [1, 2, BLOCK_N, BLOCK_K] boxes instead."""
    ok = cfg.weight_tma and tile_dim % cfg.block_n == 0
    if not one_dot:
        return _descriptor(w, [rows_per_box, cfg.block_k], ok)
    E, two_i, H = w.shape
    return _descriptor(w, [1, 2, rows_per_box, cfg.block_k], ok, (E, 2, two_i // 2, H))

def launch_persistent(kernel, precision: str, block_m: int, gemm: GemmConfig, alignment, num_routes: int,
                      num_experts: int, weight: tuple[str, torch.Tensor], tile_dim: int, weight_tiles: int, *,
                      paired: bool = False, act: tuple[str, torch.Tensor] | None = None, one_dot: bool | None = None,
                      **args) -> bool:
    """One persistent grouped-GEMM launch of `kernel` (a gate/up or down kernel of `precision`) over the tiles of
    the aligned blocks: tile_dim output columns per expert (I or H) in BLOCK_N tiles; weight = (the kernel's
    argument name, w13 or w2), passed as a TMA descriptor where gemm asks and the layout allows, `weight_tiles`
    weight tiles per K step (gate/up: 2). `paired`: the kernel walks a row tile map (kernels.row_tiles) whose full
    tiles are two alignment blocks, so its BLOCK_M is 2 * block_m. `act`: (argument name, A rows in sorted-position
    order: down's act, or gate/up's staged x rows), passed as a [BLOCK_M, BLOCK_K]-box descriptor where gemm.act_tma
    asks and the launch is unpaired (ACT_TMA). FLATTEN, WARP_SPEC: gemm.flatten, .warp_specialize, unpaired only.
    `one_dot` (bf16 gate/up; None: a kernel without ONE_DOT): gemm.one_dot's [1, 2, BN, BK] weight boxes.
    Every kernel takes the arguments named here; `args` holds the rest of its own. False (nothing launched) when
    there is no route."""
    num_pid_m = max_blocks(num_routes, num_experts, block_m)  # tiles <= blocks, paired or not
    if num_routes == 0 or num_pid_m == 0:
        return False
    tile_m = 2 * block_m if paired else block_m
    sorted_ids, expert_ids, num_post = alignment
    w_name, w = weight
    programs = persistent_programs(w.device, num_pid_m * triton.cdiv(tile_dim, gemm.block_n), tile_m, gemm,
                                   weight_tiles, operand_bytes(precision))
    w_arg, tma = weight_operand(w, gemm.block_n, gemm, tile_dim, bool(one_dot))
    if one_dot is not None:  # bf16 gate/up: ONE_DOT where the one-box descriptor was made, else two dots
        args["ONE_DOT"] = bool(one_dot) and tma
    if act is not None:
        act_arg, act_tma = _descriptor(act[1], [tile_m, gemm.block_k], gemm.act_tma and not paired)
        args.update({act[0]: act_arg, "ACT_TMA": act_tma})
    kernel[(programs,)](
        sorted_ptr=sorted_ids, expert_ids_ptr=expert_ids, num_post_ptr=num_post, num_routes=num_routes,
        num_programs=programs, **{w_name: w_arg}, **args,
        BLOCK_M=tile_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m, WEIGHT_TMA=tma,
        FLATTEN=gemm.flatten and not paired, WARP_SPEC=gemm.warp_specialize and not paired,
        UPCAST_DOT=interpreting(), num_warps=gemm.num_warps,
        num_stages=gemm.num_stages)
    return True
