"""fused_experts (docs/contracts.md "Expert computation"): the routed experts' SwiGLU MLPs, skipping -1 routes at
no GEMM cost.

    out[m] = sum over valid k of topk_weights[m,k] * (silu(x[m] @ w13[e,:I].T) * (x[m] @ w13[e,I:].T)) @ w2[e].T

`fused_experts` is the Triton path (align (moe_align_block_size's kernels) -> [paired configs: the row tile map,
kernels.row_tiles] -> gate/up + SwiGLU grouped GEMM -> down grouped GEMM with the top-k weight -> deterministic slot
sum (masked_moe_sum's kernel); see `grouped_gemm`).
`fused_experts_torch` is the literal reference (fp32 by default; bf16 compute for the eager peer); the
torch._grouped_mm peer is not a kernel of this library (moebench.peers.torch_grouped). `expert_work` is the work
(FLOPs, bytes) the op must do, the one formula every benchmark of expert computation declares.
"""

from __future__ import annotations

import torch

from moebench.kernels._details.jit import check_triton_device
from moebench.kernels.grouped_gemm import (
    ExpertsConfig,
    ExpertsWorkspace,
    alignment_buffers,
    check_routes,
    checked_workspace,
    choose_config,
    expert_operand_shapes,
    experts_choice,
    launch_config,
    make_workspace,
    routes_alignment,
    launch_tiles,
    sum_slots,
)
from moebench.kernels.grouped_gemm_bf16 import down_proj, gate_up_swiglu

# the workspace, alignment and argument checks are the launcher's (grouped_gemm), shared with fused_experts_fp8
__all__ = ["fused_experts", "fused_experts_torch",
           "ExpertsWorkspace", "make_workspace", "choose_config", "experts_choice", "expert_shapes", "check_routes",
           "expert_work", "alignment_buffers", "checked_workspace", "routes_alignment"]


def expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(M, K, E, H, I), or ValueError naming the inconsistent argument."""
    M, E, H, I = expert_operand_shapes(x, w13, w2)
    return M, check_routes(topk_weights, topk_ids, M), E, H, I


# ---------------------------------------------------------------------------------------------------------------
# The Triton path
# ---------------------------------------------------------------------------------------------------------------

def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, config: ExpertsConfig | str | None = None,
                  workspace: ExpertsWorkspace | None = None, out: torch.Tensor | None = None,
                  alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fused_experts: x [M,H] bf16, w13 [E,2I,H], w2 [E,H,I], topk_weights fp32 [M,K], topk_ids [M,K] local
    ids (-1 and ids >= E skipped) -> out [M,H] in x.dtype. No host synchronisation (CUDA-graph capturable).

    `alignment`: (sorted_token_ids, expert_ids, num_tokens_post_padded) already computed for these topk_ids
    (moe_align_block_size with block_size = the config's block_m, e.g. `choose_config(M*K, E, H, I).block_m`);
    the alignment step is then skipped, so a pipeline can time it as its own stage.
    `config`: as make_workspace's (None: the workspace's, which was chosen the same way)."""
    M, K, E, H, I = expert_shapes(x, w13, w2, topk_weights, topk_ids)
    check_triton_device(x, w13, w2, topk_weights, topk_ids)
    if out is None:
        out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    workspace = checked_workspace(workspace, (M, K, E, H, I),
                                  lambda: make_workspace(M, K, E, H, I, config=config, dtype=x.dtype, device=x.device))
    cfg = launch_config(workspace, config, x.device)
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.float().contiguous()
    ws = workspace
    sorted_ids, expert_ids, num_post = routes_alignment(topk_ids, E, cfg.block_m, ws, alignment)
    tiles = launch_tiles(cfg, expert_ids, num_post, ws.tiles)
    gate_up_swiglu(x, w13, sorted_ids, expert_ids, num_post, K, cfg.block_m, cfg.gate_up, ws.act, tiles, ws.x_rows)
    down_proj(ws.act, w2, topk_weights, sorted_ids, expert_ids, num_post, cfg.block_m, cfg.down, ws.y, tiles)
    return sum_slots(ws.y, topk_ids, E, out, block_h=cfg.reduce_block_h)


# ---------------------------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------------------------

def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The contract literally: per expert, the valid slots routed to it; h = x @ w13[e].T, a = silu(h[:, :I]) *
    h[:, I:], y = a @ w2[e].T (matmuls in `compute_dtype`; SwiGLU in fp32 then rounded to compute_dtype), then
    out[m] = sum over valid k (ascending) of topk_weights[m,k] * y_k in fp32. Output dtype: out_dtype or x.dtype."""
    M, K, E, H, I = expert_shapes(x, w13, w2, topk_weights, topk_ids)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    per_slot = torch.zeros(M, K, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        rows = x.index_select(0, tok).to(compute_dtype)
        h = rows @ w13[e].to(compute_dtype).T
        a = (torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()).to(compute_dtype)
        y = a @ w2[e].to(compute_dtype).T
        per_slot[tok, slot] = y.float() * topk_weights[tok, slot].float()[:, None]
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for k in range(K):
        out += torch.where(valid[:, k, None], per_slot[:, k], 0.0)
    return out.to(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Work accounting
# ---------------------------------------------------------------------------------------------------------------

BF16_BYTES = 2


def expert_work(routes: int, experts_used: int, rows_read: int, hidden: int, intermediate: int, *,
                out_rows: int | None = None, top_k: int = 0) -> tuple[int, int]:
    """(flops, bytes) the routed experts' SwiGLU MLPs must do / move for `routes` (token, expert) pairs (bf16).

    FLOPs: 2 * routes * (H*2I + I*H), the gate/up and the down GEMMs. Bytes: the weights of each expert with a
    route (3*H*I each, read once), the `rows_read` rows of x (tokens with a route) read once, act [routes, I]
    written and read back, y [routes, H] written. With `out_rows` (fused_experts, whose slot sum is part of the op):
    y read back by the sum, out [out_rows, H] written and the ids [out_rows, top_k] read (counted as int64). A
    pipeline that times the reduction as a stage of its own (the layer) passes no out_rows.
    """
    H, I = hidden, intermediate
    flops = 2 * routes * (H * 2 * I + I * H)
    nbytes = (experts_used * 3 * H * I * BF16_BYTES + rows_read * H * BF16_BYTES
              + routes * (2 * I * BF16_BYTES + H * BF16_BYTES))
    if out_rows is not None:
        nbytes += routes * H * BF16_BYTES + out_rows * H * BF16_BYTES + out_rows * top_k * 8
    return flops, nbytes
