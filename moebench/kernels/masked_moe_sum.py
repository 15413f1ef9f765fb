"""masked_moe_sum: reduce the top-k expert outputs of each token, skipping slots whose id is -1 (docs/contracts.md).

out[m] = sum over k with topk_ids[m, k] >= 0 of intermediate[m, k], accumulated in fp32 in order k = 0..K-1 and
rounded once to the intermediate's dtype. A skipped slot is never loaded: the Triton kernel derives each load's
mask from the slot's id, so a skipped slot issues no memory traffic and NaN/garbage there cannot reach the output.
A row whose slots are all -1 yields zeros.

The Triton kernel takes one row x 512 columns per program by default (sum_launch_config, the rule where the
tuned table has no entry; sum_choice): a padded row (all
slots -1) only stores zeros, without loading anything, and a real one keeps K x 1 KB of loads in flight. fused_experts' slot sum uses the same kernel, with
ids >= num_experts skipped as well (`launch_masked_sum(..., num_experts=E)`).

The pre-fix path (`torch.sum(intermediate, dim=1)`, vLLM's ops.moe_sum) adds every slot: `moe_sum_oblivious`, the
oblivious twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, next_pow2
from moebench.kernels._details.rounding import round_store_value, soft_bf16
from moebench.kernels._details.tuning import Choice, Tunable, choose, pow2_bucket, register_tunable

__all__ = ["masked_moe_sum", "masked_moe_sum_torch", "moe_sum_oblivious", "SumLaunch", "SUM_CANDIDATES",
           "sum_launch_config", "sum_choice", "sum_grid", "launch_masked_sum", "sum_slots", "sum_slots_torch"]


def masked_moe_sum_torch(intermediate: torch.Tensor, topk_ids: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: fp32 accumulation over the valid slots in order k = 0..K-1, rounded once.

    A skipped slot's value is discarded by `where` (so NaN there cannot propagate); no host synchronisation.
    """
    M, K, H = intermediate.shape
    if topk_ids.shape != (M, K):
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} != {(M, K)}")
    acc = torch.zeros(M, H, dtype=torch.float32, device=intermediate.device)
    for k in range(K):
        valid = (topk_ids[:, k] >= 0).unsqueeze(1)
        acc = torch.where(valid, acc + intermediate[:, k].float(), acc)
    if out is None:
        return acc.to(intermediate.dtype)
    out.copy_(acc)
    return out


def moe_sum_oblivious(intermediate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The pre-fix reduction: every slot is added, whatever its id (NaN in a skipped slot reaches the output)."""
    if out is None:
        return intermediate.sum(dim=1)
    return torch.sum(intermediate, dim=1, out=out)


@triton.jit
def _masked_moe_sum_kernel(inter_ptr, topk_ids_ptr, out_ptr, num_rows, hidden, num_experts,
                           stride_inter_m, stride_inter_k, stride_ids_m, stride_ids_k, stride_out_m,
                           TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                           HAS_UPPER: tl.constexpr, SOFT_BF16: tl.constexpr, LOAD_HINT: tl.constexpr):
    """out[rows, cols] for ROWS rows x BLOCK_H columns. A slot counts when its id is >= 0 (and < num_experts with
    HAS_UPPER); a row block without any such slot writes zeros without a single load of `intermediate`."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    out_ptrs = out_ptr + rows[:, None] * stride_out_m + cols[None, :]
    out_mask = row_ok[:, None] & (cols < hidden)[None, :]

    slots = tl.arange(0, TOP_K_PAD)
    ids = tl.load(topk_ids_ptr + rows[:, None] * stride_ids_m + slots[None, :] * stride_ids_k,
                  mask=row_ok[:, None] & (slots < TOP_K)[None, :], other=-1)
    valid = ids >= 0
    if HAS_UPPER:
        valid = valid & (ids < num_experts)
    if tl.sum(tl.sum(valid.to(tl.int32), axis=1), axis=0) == 0:
        # Padded rows (every slot -1): zeros, no loads.
        tl.store(out_ptrs, tl.zeros([ROWS, BLOCK_H], dtype=out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            expert = tl.load(topk_ids_ptr + rows * stride_ids_m + k * stride_ids_k, mask=row_ok, other=-1)
            take_row = expert >= 0
            if HAS_UPPER:
                take_row = take_row & (expert < num_experts)
            # A skipped slot's load is fully predicated off, so it issues no memory traffic. (One compare per
            # element against a per-row limit: the interpreter mishandles `bool block & bool scalar`.)
            take = cols[None, :] < tl.where(take_row, hidden, 0)[:, None]
            x_ptrs = inter_ptr + rows[:, None] * stride_inter_m + k * stride_inter_k + cols[None, :]
            if LOAD_HINT == "evict_first":  # each slot is read once
                x = tl.load(x_ptrs, mask=take, other=0.0, eviction_policy="evict_first")
            elif LOAD_HINT == "cg":  # cached in L2 only
                x = tl.load(x_ptrs, mask=take, other=0.0, cache_modifier=".cg")
            else:
                x = tl.load(x_ptrs, mask=take, other=0.0)
            acc = tl.where(take, acc + x.to(tl.float32), acc)
        tl.store(out_ptrs, round_store_value(acc, out_ptr.dtype.element_ty, SOFT_BF16), mask=out_mask)


@dataclass(frozen=True)
class SumLaunch:
    """Launch shape of the masked sum: rows x columns per program, warps, and the slot loads' cache hint
    ("evict_first", "cg": L2 only, or "none"). The output does not depend on it."""

    rows: int = 2
    block_h: int = 1024
    num_warps: int = 4
    load_hint: str = "evict_first"

    def __post_init__(self):
        if self.load_hint not in LOAD_HINTS:
            raise ValueError(f"load_hint {self.load_hint!r}: one of {', '.join(LOAD_HINTS)}")

    @property
    def name(self) -> str:
        """The candidate name of this launch shape (the rule's launches are named the same way)."""
        return f"r{self.rows}_h{self.block_h}_w{self.num_warps}_{self.load_hint}"


LOAD_HINTS = ("evict_first", "cg", "none")


# The candidate table (`config:` of a sweep, `moebench tune sweeps/tune_moe_sum.yaml`): rows x columns per program,
# warps, cache hint; r1_h512_w1_none is sum_launch_config's choice at H >= 512, the others its neighbours and the
# two-row launch top_k 1 keeps.
SUM_CANDIDATES: dict[str, SumLaunch] = {c.name: c for c in (
    SumLaunch(1, 512, 1, "none"),
    SumLaunch(1, 1024, 4, "none"),
    SumLaunch(1, 1024, 4, "cg"),
    SumLaunch(1, 1024, 2, "none"),
    SumLaunch(1, 1024, 8, "none"),
    SumLaunch(1, 2048, 8, "none"),
    SumLaunch(1, 2048, 4, "none"),
    SumLaunch(1, 512, 2, "none"),
    SumLaunch(2, 1024, 4, "none"),
    SumLaunch(2, 1024, 4, "cg"),
    SumLaunch(2, 1024, 4, "evict_first"),  # the top_k == 1 launch
)}


def sum_launch_config(hidden: int, block_h: int = 512, rows: int = 1, top_k: int = 8) -> SumLaunch:
    """One row x up to 512 columns per program on one warp (16 bytes per lane and slot), loads without a cache
    hint: many small programs keep the most loads in flight, and a padded row costs one tiny program (the fastest
    of SUM_CANDIDATES on the H200, docs/benchmarks.md#top-k-reduction-masked_moe_sum). Wider blocks (fused_experts'
    slot sum) get a warp per 512 columns.

    top_k == 1 takes two rows x up to 1024 columns, evict-first: with a single slot a 512-column program has
    only 1 KB in flight, too little to hide the loads' latency."""
    if top_k == 1:
        block_h = min(max(block_h, 1024), next_pow2(hidden))
        return SumLaunch(2, block_h, max(1, min(4, block_h // 256)), "evict_first")
    block_h = min(block_h, next_pow2(hidden))
    return SumLaunch(rows, block_h, max(1, min(4, block_h // 512)), "none")


def _sum_bucket(num_rows: int, top_k: int, hidden: int) -> str:
    return f"T={pow2_bucket(num_rows)},K={top_k},H={hidden}"


def _sum_rule(num_rows: int, top_k: int, hidden: int) -> tuple[str, SumLaunch]:
    launch = sum_launch_config(hidden, top_k=top_k)
    return launch.name, launch


register_tunable(Tunable("masked_moe_sum", SUM_CANDIDATES, _sum_bucket, _sum_rule,
                         "sum_launch_config(H, top_k=K): one row x min(512, next_pow2(H)) columns, no cache hint; "
                         "top_k 1: two rows x 1024 columns, evict-first"))


def sum_choice(num_rows: int, top_k: int, hidden: int, device=None, config: str | SumLaunch | None = None) -> Choice:
    """The launch masked_moe_sum takes for [num_rows, top_k, hidden] on `device` (kernels._details.tuning.choose):
    `config` (a SUM_CANDIDATES name or a SumLaunch), else the tuned table's entry for bucket
    T=next_pow2(rows),K,H, else sum_launch_config."""
    return choose("masked_moe_sum", device, config, num_rows=num_rows, top_k=top_k, hidden=hidden)


def sum_grid(num_rows: int, hidden: int, launch: SumLaunch) -> tuple[int, int]:
    """The kernel's grid: a program per block of `launch.rows` rows and `launch.block_h` columns."""
    return triton.cdiv(num_rows, launch.rows), triton.cdiv(hidden, launch.block_h)


def launch_masked_sum(intermediate: torch.Tensor, strides: tuple[int, int], topk_ids: torch.Tensor,
                      out: torch.Tensor, *, num_experts: int | None = None, launch: SumLaunch | None = None) -> None:
    """out[m] = sum over valid k of intermediate[m*strides[0] + k*strides[1] + :H] (element strides; the last
    dimension contiguous). Valid: id >= 0, and id < num_experts when given. fp32 in order k, rounded once."""
    M, K = topk_ids.shape
    H = out.shape[1]
    launch = launch or sum_launch_config(H, top_k=K)
    grid = sum_grid(M, H, launch)
    _masked_moe_sum_kernel[grid](
        intermediate, topk_ids, out, M, H, num_experts if num_experts is not None else 0,
        strides[0], strides[1], topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        TOP_K=K, TOP_K_PAD=next_pow2(K), ROWS=launch.rows, BLOCK_H=launch.block_h,
        HAS_UPPER=num_experts is not None, SOFT_BF16=soft_bf16(out), LOAD_HINT=launch.load_hint,
        num_warps=launch.num_warps)


def masked_moe_sum(intermediate: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None = None, *,
                   config: str | SumLaunch | None = None) -> torch.Tensor:
    """Triton masked reduction over top-k: intermediate [M, K, H], topk_ids [M, K] -> out [M, H].
    `config`: a SUM_CANDIDATES name or a SumLaunch; None (or "auto"): the tuned table, else the rule (sum_choice).
    The output does not depend on it."""
    if intermediate.dim() != 3:
        raise ValueError(f"intermediate must be [M, K, H], got shape {tuple(intermediate.shape)}")
    M, K, H = intermediate.shape
    if topk_ids.shape != (M, K):
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} != {(M, K)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check_triton_device(intermediate, topk_ids, out)
    if intermediate.stride(2) != 1:
        intermediate = intermediate.contiguous()
    if out is None:
        out = torch.empty(M, H, dtype=intermediate.dtype, device=intermediate.device)
    if out.shape != (M, H) or out.dtype != intermediate.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major [{M}, {H}] {intermediate.dtype} tensor")
    if M == 0 or H == 0:
        return out
    if K == 0:
        return out.zero_()
    launch = sum_choice(M, K, H, intermediate.device, config).config
    launch_masked_sum(intermediate, (intermediate.stride(0), intermediate.stride(1)), topk_ids, out, launch=launch)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The slot sum of the expert GEMMs (kernels.grouped_gemm): y [M*K, H] per route, ids >= num_experts skipped too
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
