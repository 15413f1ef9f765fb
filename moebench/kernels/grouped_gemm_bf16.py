"""The bf16 grouped GEMMs of the expert computation: gate_up_swiglu and down_proj (persistent Triton kernels, one
block or a pair of blocks a tile) and their plain-torch references `<name>_torch`.

They run on kernels.grouped_gemm's alignment, workspace and persistent launch (`launch_persistent`) and begin each
tile with its `swizzle` / `tile_rows`; fused_experts chains them, the layer runs them stage by stage
(moebench.bench.layer). The fp8 block-scaled kernels are kernels.fused_experts_fp8's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.experts_config import BF16, GemmConfig
from moebench.kernels._details.rounding import round_store_value, soft_bf16
from moebench.kernels.grouped_gemm import gate_up_rows, launch_persistent, max_blocks, swizzle, tile_rows

__all__ = ["gate_up_swiglu", "down_proj", "gate_up_swiglu_torch", "down_proj_torch"]


@triton.jit
def _paired_tile(tile, num_pid_m, num_pid_n, tile_map_ptr, GROUP_M: tl.constexpr, ALIGN_M: tl.constexpr):
    """A paired launch's tile -> (pid_n, first sorted position, whether it spans two blocks) from the tile map."""
    pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
    code = tl.load(tile_map_ptr + pid_m)  # 2 * first block + (two blocks)
    return pid_n, tl.multiple_of((code >> 1) * ALIGN_M, ALIGN_M), (code & 1) != 0


@triton.jit
def _release_tile_counter(counter_ptr, num_programs):
    """A paired launch's last act per program: counter_ptr = (next tile, programs done); the last program to finish
    (all have taken their final tile by then) zeroes both, so the next launch on the same tile map starts at 0."""
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel")
    if done == num_programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed")


@triton.jit
def _gate_up_tile(first_row, pid_n, x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_routes, top_k, hidden,
                  inter, stride_xm, stride_we, stride_wn, stride_am, BLOCK_M: tl.constexpr, ALIGN_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                  ACT_TMA: tl.constexpr, ONE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One [BLOCK_M, 2*BLOCK_N] tile of the gate/up GEMM and its SwiGLU: act rows first_row .. + BLOCK_M.
    ONE_DOT: w13 is a descriptor over its [E, 2, I, H] view with [1, 2, BLOCK_N, BLOCK_K] boxes (the tile's gate and
    up rows in one box): one [BLOCK_M, 2*BLOCK_N] MMA a K step, split into gate and up after the loop.
    ACT_TMA: x_ptr is a TMA descriptor over the staged rows (kernels.stage_rows: row j = x of the route at sorted
    position j, pad rows zero) with [BLOCK_M, BLOCK_K] boxes; else the rows are gathered from x by token."""
    expert, offs_m, route, row_ok = tile_rows(first_row, sorted_ptr, expert_ids_ptr, num_routes, BLOCK_M, ALIGN_M)
    offs_k = tl.arange(0, BLOCK_K)
    token = (route // top_k).to(tl.int64)
    # columns wrap modulo I so loads need no N mask (the store masks them); gate rows n, up rows I + n
    offs_n_store = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = offs_n_store % inter
    if not ACT_TMA:
        x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    if WEIGHT_TMA:
        gate_row = (expert * 2 * inter + pid_n * BLOCK_N).to(tl.int32)
    else:
        g_ptrs = w13 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + inter * stride_wn
    if ONE_DOT:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        if not EVEN_K:
            k_ok = offs_k < hidden - kb * BLOCK_K
        if ACT_TMA:  # pad rows are zeros in the staged copy; a K tail is zero-filled
            a = x_ptr.load([first_row.to(tl.int32), kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if ONE_DOT:  # [1, 2, BN, BK]: gate rows then up rows, one B operand
            w = tl.reshape(w13.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, kb * BLOCK_K]), (2 * BLOCK_N, BLOCK_K))
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc)
        elif WEIGHT_TMA:  # out-of-range columns (a K tail) are zero-filled by the TMA unit
            g = tl.trans(w13.load([gate_row, kb * BLOCK_K]))
            u = tl.trans(w13.load([gate_row + inter, kb * BLOCK_K]))
        elif EVEN_K:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if not ONE_DOT:
            if UPCAST_DOT:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact here
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        if not ACT_TMA:
            x_ptrs += BLOCK_K
        if not WEIGHT_TMA:
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    if ONE_DOT:  # columns [0, BN) gate, [BN, 2BN) up: a thread's MMA registers hold column c and c + BN alike
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n_store[None, :]
    tl.store(a_ptrs, round_store_value(act, act_ptr.dtype.element_ty, SOFT_BF16),
             mask=(offs_n_store < inter)[None, :])


@triton.jit
def _gate_up_swiglu_kernel(x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, tile_map_ptr,
                           num_tiles_ptr, num_routes, top_k, hidden, inter, num_programs,
                           stride_xm, stride_we, stride_wn, stride_am,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                           ACT_TMA: tl.constexpr, ONE_DOT: tl.constexpr, FLATTEN: tl.constexpr,
                           WARP_SPEC: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
                           PAIRED: tl.constexpr, ALIGN_M: tl.constexpr):
    """Persistent: program p takes tiles p, p + num_programs, ... of the blocks that exist (num_post_padded is
    read on the device; PAIRED: the tile map's count, the tiles taken in order from its counter), so skipped routes
    cost no program at all.
    w13: a pointer to [E, 2I, H], or (WEIGHT_TMA) a TMA descriptor over its [E*2I, H] view with
    [BLOCK_N, BLOCK_K] boxes (then I % BLOCK_N == 0, so a box never crosses the gate/up or expert boundary).
    PAIRED: BLOCK_M is two alignment blocks; a tile of one block (an expert's odd last) runs BLOCK_M // 2 rows."""
    num_pid_n = tl.cdiv(inter, BLOCK_N)
    if PAIRED:
        # tiles of two sizes: taken in order from the counter num_tiles[1] (kernels.row_tiles says why)
        num_pid_m = tl.load(num_tiles_ptr)
        tile = tl.atomic_add(num_tiles_ptr + 1, 1, sem="relaxed")
        while tile < num_pid_m * num_pid_n:
            pid_n, first_row, two_blocks = _paired_tile(tile, num_pid_m, num_pid_n, tile_map_ptr, GROUP_M, ALIGN_M)
            if two_blocks:
                _gate_up_tile(first_row, pid_n, x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_routes, top_k,
                              hidden, inter, stride_xm, stride_we, stride_wn, stride_am, BLOCK_M, ALIGN_M, BLOCK_N,
                              BLOCK_K, EVEN_K, WEIGHT_TMA, False, ONE_DOT, UPCAST_DOT, SOFT_BF16)
            else:
                _gate_up_tile(first_row, pid_n, x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_routes, top_k,
                              hidden, inter, stride_xm, stride_we, stride_wn, stride_am, ALIGN_M, ALIGN_M, BLOCK_N,
                              BLOCK_K, EVEN_K, WEIGHT_TMA, False, ONE_DOT, UPCAST_DOT, SOFT_BF16)
            tile = tl.atomic_add(num_tiles_ptr + 1, 1, sem="relaxed")
        _release_tile_counter(num_tiles_ptr + 1, num_programs)
    else:
        num_pid_m = tl.load(num_post_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
            _gate_up_tile(pid_m * BLOCK_M, pid_n, x_ptr, w13, act_ptr, sorted_ptr, expert_ids_ptr, num_routes,
                          top_k, hidden, inter, stride_xm, stride_we, stride_wn, stride_am, BLOCK_M, BLOCK_M, BLOCK_N,
                          BLOCK_K, EVEN_K, WEIGHT_TMA, ACT_TMA, ONE_DOT, UPCAST_DOT, SOFT_BF16)


@triton.jit
def _down_tile(first_row, pid_n, act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_routes, hidden,
               inter, stride_am, stride_we, stride_wn, stride_ym, BLOCK_M: tl.constexpr, ALIGN_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
               ACT_TMA: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of the down GEMM: y at the routes of sorted positions first_row .. + BLOCK_M.
    ACT_TMA: act_ptr is a TMA descriptor over act [positions, I] with [BLOCK_M, BLOCK_K] boxes."""
    expert, offs_m, route, row_ok = tile_rows(first_row, sorted_ptr, expert_ids_ptr, num_routes, BLOCK_M, ALIGN_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n_store = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = offs_n_store % hidden
    # act rows are sorted positions: a block's rows are contiguous, every one written by the gate/up kernel
    if not ACT_TMA:
        a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    if WEIGHT_TMA:
        w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w2 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        if not EVEN_K:
            k_ok = offs_k < inter - kb * BLOCK_K
        if ACT_TMA:  # a K tail is zero-filled by the TMA unit
            a = act_ptr.load([first_row.to(tl.int32), kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
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
        if not ACT_TMA:
            a_ptrs += BLOCK_K
        if not WEIGHT_TMA:
            w_ptrs += BLOCK_K
    weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    y_ptrs = y_ptr + route.to(tl.int64)[:, None] * stride_ym + offs_n_store[None, :]
    tl.store(y_ptrs, round_store_value(acc, y_ptr.dtype.element_ty, SOFT_BF16),
             mask=row_ok[:, None] & (offs_n_store < hidden)[None, :])


@triton.jit
def _down_proj_kernel(act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, tile_map_ptr,
                      num_tiles_ptr, num_routes, hidden, inter, num_programs,
                      stride_am, stride_we, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                      ACT_TMA: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                      SOFT_BF16: tl.constexpr, PAIRED: tl.constexpr, ALIGN_M: tl.constexpr):
    """Persistent like the gate/up kernel, over the same tiles. w2: a pointer to [E, H, I], or (WEIGHT_TMA) a
    descriptor over its [E*H, I] view (H % BLOCK_N == 0); act likewise (ACT_TMA: unpaired launches only)."""
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    if PAIRED:  # the counter num_tiles[3]
        num_pid_m = tl.load(num_tiles_ptr)
        tile = tl.atomic_add(num_tiles_ptr + 3, 1, sem="relaxed")
        while tile < num_pid_m * num_pid_n:
            pid_n, first_row, two_blocks = _paired_tile(tile, num_pid_m, num_pid_n, tile_map_ptr, GROUP_M, ALIGN_M)
            if two_blocks:
                _down_tile(first_row, pid_n, act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_routes,
                           hidden, inter, stride_am, stride_we, stride_wn, stride_ym, BLOCK_M, ALIGN_M, BLOCK_N,
                           BLOCK_K, EVEN_K, WEIGHT_TMA, False, UPCAST_DOT, SOFT_BF16)
            else:
                _down_tile(first_row, pid_n, act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_routes,
                           hidden, inter, stride_am, stride_we, stride_wn, stride_ym, ALIGN_M, ALIGN_M, BLOCK_N,
                           BLOCK_K, EVEN_K, WEIGHT_TMA, False, UPCAST_DOT, SOFT_BF16)
            tile = tl.atomic_add(num_tiles_ptr + 3, 1, sem="relaxed")
        _release_tile_counter(num_tiles_ptr + 3, num_programs)
    else:
        num_pid_m = tl.load(num_post_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
            _down_tile(pid_m * BLOCK_M, pid_n, act_ptr, w2, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_routes,
                       hidden, inter, stride_am, stride_we, stride_wn, stride_ym, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K,
                       EVEN_K, WEIGHT_TMA, ACT_TMA, UPCAST_DOT, SOFT_BF16)


def _tile_args(tiles, sorted_ids: torch.Tensor, block_m: int) -> dict:
    """The bf16 kernels' tile-map arguments: `tiles` = (tile_map, num_tiles) of row_tile_map for a paired launch,
    None for one block a tile (then the pointers are unused placeholders)."""
    if tiles is None:
        return dict(tile_map_ptr=sorted_ids, num_tiles_ptr=sorted_ids, PAIRED=False, paired=False, ALIGN_M=block_m)
    tile_map, num_tiles = tiles
    return dict(tile_map_ptr=tile_map, num_tiles_ptr=num_tiles, PAIRED=True, paired=True, ALIGN_M=block_m)


def gate_up_swiglu(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                   num_post: torch.Tensor, top_k: int, block_m: int, cfg: GemmConfig, act: torch.Tensor,
                   tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                   x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """act[j, :] for every sorted position j < num_post (rows of pad entries are zeros). `tiles`: row_tile_map's
    (tile_map, num_tiles) for these blocks: a paired launch (two blocks a tile); None: one block a tile.
    `x_rows`: the staging buffer of a cfg.act_tma launch (grouped_gemm.staging_buffer): x's rows are staged into it
    and read through TMA; None: gathered by token."""
    M, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    assert M * top_k == 0 or (act.shape[0] >= max_blocks(M * top_k, E, block_m) * block_m
                              and act.shape[1] == inter and act.stride(1) == 1)
    launch_persistent(_gate_up_swiglu_kernel, BF16, block_m, cfg, (sorted_ids, expert_ids, num_post), M * top_k, E,
                      ("w13", w13), inter, 2, one_dot=cfg.one_dot, act_ptr=act, top_k=top_k, hidden=H, inter=inter,
                      stride_xm=x.stride(0), stride_we=w13.stride(0), stride_wn=w13.stride(1),
                      stride_am=act.stride(0), EVEN_K=H % cfg.block_k == 0, SOFT_BF16=soft_bf16(act),
                      **gate_up_rows(cfg, x, sorted_ids, num_post, top_k, x_rows, tiles is not None),
                      **_tile_args(tiles, sorted_ids, block_m))
    return act


def down_proj(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
              expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int, cfg: GemmConfig, y: torch.Tensor,
              tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y[i, :] = topk_weights.flat[i] * act[j] @ w2[e].T for each placed route i (sorted position j); the rows of
    skipped routes are not written. `tiles`: as gate_up_swiglu's."""
    E, H, inter = w2.shape
    num_routes = topk_weights.numel()
    assert num_routes == 0 or (y.shape == (num_routes, H) and y.stride(1) == 1 and topk_weights.is_contiguous())
    launch_persistent(_down_proj_kernel, BF16, block_m, cfg, (sorted_ids, expert_ids, num_post), num_routes, E,
                      ("w2", w2), H, 1, act=("act_ptr", act), y_ptr=y, topk_w_ptr=topk_weights, hidden=H, inter=inter,
                      stride_am=act.stride(0), stride_we=w2.stride(0), stride_wn=w2.stride(1), stride_ym=y.stride(0),
                      EVEN_K=inter % cfg.block_k == 0, SOFT_BF16=soft_bf16(y),
                      **_tile_args(tiles, sorted_ids, block_m))
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
