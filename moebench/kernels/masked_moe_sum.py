"""masked_moe_sum: reduce the top-k expert outputs of each token, skipping slots whose id is -1 (SPEC.md).

out[m] = sum over k with topk_ids[m, k] >= 0 of intermediate[m, k], accumulated in fp32 in order k = 0..K-1 and
rounded once to the intermediate's dtype. A skipped slot is never loaded: the Triton kernel derives each load's
mask from the slot's id, so a skipped slot issues no memory traffic and NaN/garbage there cannot reach the output.
A row whose slots are all -1 yields zeros.

The Triton kernel takes two rows per program: a padded row pair (all slots -1) only stores zeros, without loading
anything, and a real pair keeps 2 x K x 2 KB of loads in flight. fused_experts' slot sum uses the same kernel, with
ids >= num_experts skipped as well (`launch_masked_sum(..., num_experts=E)`).

The pre-fix path (`torch.sum(intermediate, dim=1)`, vLLM's ops.moe_sum) adds every slot; it is registered as the
oblivious twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, interpreting, next_pow2


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
def _round_store_value(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 -> output dtype. SOFT_BF16 (CPU interpreter only, whose fp32->bf16 cast truncates): round to nearest
    even on the bit pattern, as the GPU's cvt.rn does, so CPU results match the GPU's rounding."""
    if SOFT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


def soft_bf16(t: torch.Tensor) -> bool:
    return interpreting() and t.dtype == torch.bfloat16


@triton.jit
def _masked_moe_sum_kernel(inter_ptr, topk_ids_ptr, out_ptr, num_rows, hidden, num_experts,
                           stride_inter_m, stride_inter_k, stride_ids_m, stride_ids_k, stride_out_m,
                           TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                           HAS_UPPER: tl.constexpr, SOFT_BF16: tl.constexpr):
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
            x = tl.load(inter_ptr + rows[:, None] * stride_inter_m + k * stride_inter_k + cols[None, :], mask=take,
                        other=0.0, eviction_policy="evict_first")
            acc = tl.where(take, acc + x.to(tl.float32), acc)
        tl.store(out_ptrs, _round_store_value(acc, out_ptr.dtype.element_ty, SOFT_BF16), mask=out_mask)


@dataclass(frozen=True)
class SumLaunch:
    """Launch shape of the masked sum: rows x columns per program, warps."""

    rows: int = 2
    block_h: int = 1024
    num_warps: int = 4

    def short(self) -> str:
        return f"rows{self.rows} H{self.block_h} w{self.num_warps}"


def sum_launch_config(hidden: int, block_h: int = 1024, rows: int = 2) -> SumLaunch:
    """Two rows x up to 1024 columns per program (7168 = 7 x 1024), 8 bf16 (16 bytes) per thread and row: 16 KB
    of loads in flight per row pair and slot group, and a padded row pair costs one small program."""
    block_h = min(block_h, next_pow2(hidden))
    return SumLaunch(rows, block_h, max(1, min(4, block_h // 256)))


def launch_masked_sum(intermediate: torch.Tensor, strides: tuple[int, int], topk_ids: torch.Tensor,
                      out: torch.Tensor, *, num_experts: int | None = None, launch: SumLaunch | None = None) -> None:
    """out[m] = sum over valid k of intermediate[m*strides[0] + k*strides[1] + :H] (element strides; the last
    dimension contiguous). Valid: id >= 0, and id < num_experts when given. fp32 in order k, rounded once."""
    M, K = topk_ids.shape
    H = out.shape[1]
    launch = launch or sum_launch_config(H)
    grid = (triton.cdiv(M, launch.rows), triton.cdiv(H, launch.block_h))
    _masked_moe_sum_kernel[grid](
        intermediate, topk_ids, out, M, H, num_experts if num_experts is not None else 0,
        strides[0], strides[1], topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        TOP_K=K, TOP_K_PAD=next_pow2(K), ROWS=launch.rows, BLOCK_H=launch.block_h,
        HAS_UPPER=num_experts is not None, SOFT_BF16=soft_bf16(out), num_warps=launch.num_warps)


def masked_moe_sum(intermediate: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None = None, *,
                   launch: SumLaunch | None = None) -> torch.Tensor:
    """Triton masked reduction over top-k: intermediate [M, K, H], topk_ids [M, K] -> out [M, H].
    `launch` overrides the launch shape (the GPU script sweeps it)."""
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
    launch_masked_sum(intermediate, (intermediate.stride(0), intermediate.stride(1)), topk_ids, out, launch=launch)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Registration (target "kernel")
# ---------------------------------------------------------------------------------------------------------------

def _compare_nan_aware(name: str, out: torch.Tensor, ref: torch.Tensor, max_rel: float, rms_rel: float):
    """NaN positions must match exactly; the finite elements are compared by max/RMS relative error."""
    from moebench.check import compare_close
    from moebench.registry import CheckResult

    out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
    nan_mismatch = int((out_nan != ref_nan).sum().item())
    finite = ~(out_nan | ref_nan)
    close = compare_close(name, out[finite], ref[finite], max_rel, rms_rel)
    ok = close.ok and nan_mismatch == 0
    detail = close.detail if nan_mismatch == 0 else f"{name}: NaN in {nan_mismatch} places the reference has none"
    return CheckResult(ok, "" if ok else detail, {**close.metrics, f"{name}.nan_mismatches": float(nan_mismatch)})


def _build_sum(variant: str):
    def build(p, ctx):
        from moebench.check import compare_close, compare_exact, poison
        from moebench.inputs import generator, make_batch, route
        from moebench.registry import Case, CheckResult, Routing

        batch = make_batch(p, ctx.device, need_hidden=False)
        _, topk_ids = route(p, batch)
        T, K = topk_ids.shape
        H = p.hidden
        g = generator(p.seed * 1_000_003 + 4243, ctx.device)
        intermediate = torch.randn(T, K, H, generator=g, device=ctx.device, dtype=torch.bfloat16)
        skipped = topk_ids < 0
        intermediate[skipped] = float("nan")  # an implementation that loads a skipped slot shows NaN
        out = torch.empty(T, H, dtype=intermediate.dtype, device=ctx.device)
        ref = masked_moe_sum_torch(intermediate, topk_ids)
        info = {}

        if variant == "oblivious":
            def run():
                return moe_sum_oblivious(intermediate, out=out)
            unmasked_ref = masked_moe_sum_torch(intermediate, torch.zeros_like(topk_ids))

            def check():
                poison(out)
                run()
                info["nan_rows"] = int(torch.isnan(out).any(dim=1).sum())  # rows the skipped slots poisoned
                return _compare_nan_aware("out", out, unmasked_ref, 1e-2, 1e-3)
            # Harm done: rows with a skipped slot whose output is not the masked result (bit for bit).
            got = moe_sum_oblivious(intermediate)
            differs = (got.view(torch.int16) != ref.view(torch.int16)).any(dim=1)
            info["corrupted_rows"] = int((differs & skipped.any(dim=1)).sum().item())
            slots_read = T * K
        else:
            if variant == "torch":
                def run():
                    return masked_moe_sum_torch(intermediate, topk_ids, out=out)
            else:
                def run():
                    return masked_moe_sum(intermediate, topk_ids, out=out)

            def check():
                poison(out)
                run()
                info["nan_rows"] = int(torch.isnan(out).any(dim=1).sum())  # rows the skipped slots poisoned
                # fp32 accumulation in the same order: bitwise on a GPU; the CPU interpreter rounds fp32 -> bf16
                # differently, hence the tolerance. The exact-mismatch count is reported either way.
                res = compare_close("out", out, ref, 1e-2, 1e-2)
                exact = compare_exact("out", out, ref)
                return CheckResult(res.ok, res.detail, {**res.metrics, **exact.metrics})
            slots_read = int((~skipped).sum().item())

        elt = intermediate.element_size()
        return Case(run=run, check=check,
                    bytes_moved=slots_read * H * elt + T * H * elt + topk_ids.numel() * topk_ids.element_size(),
                    bytes_note="slots read (valid only when masked) + output written + ids",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size),
                    info=info, nvtx_stage="reduce")
    return build


def _register() -> None:
    from moebench.registry import Impl, register

    descriptions = {
        "triton": "Triton masked top-k sum (bf16 [T,K,H]); -1 slots are never loaded",
        "torch": "eager torch masked sum, fp32 accumulation in slot order (the reference)",
        "oblivious": "pre-fix torch.sum(dim=1): adds every slot, NaN/garbage in -1 slots reaches the output",
    }
    for variant, text in descriptions.items():
        register(Impl(f"masked_moe_sum.{variant}", targets=("kernel",), build=_build_sum(variant),
                      description=text, mask_aware=variant != "oblivious"))


_register()
