"""masked_moe_sum: reduce the top-k expert outputs of each token, skipping slots whose id is -1 (SPEC.md).

out[m] = sum over k with topk_ids[m, k] >= 0 of intermediate[m, k], accumulated in fp32 in order k = 0..K-1 and
rounded once to the intermediate's dtype. A skipped slot is never loaded: the Triton kernel derives each load's
mask from the slot's id, so a skipped slot issues no memory traffic and NaN/garbage there cannot reach the output.
A row whose slots are all -1 yields zeros.

The pre-fix path (`torch.sum(intermediate, dim=1)`, vLLM's ops.moe_sum) adds every slot; it is registered as the
oblivious twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._triton import check_triton_device, next_pow2


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
def _masked_moe_sum_kernel(inter_ptr, topk_ids_ptr, out_ptr, hidden, stride_inter_m, stride_inter_k,
                           stride_ids_m, stride_ids_k, stride_out_m,
                           TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + row * stride_ids_m + k * stride_ids_k)
        # A skipped slot's load is fully predicated off, so it issues no memory traffic. (Folded into one
        # compare: the interpreter mishandles `bool block & bool scalar`.)
        take = cols < tl.where(expert >= 0, hidden, 0)
        x = tl.load(inter_ptr + row * stride_inter_m + k * stride_inter_k + cols, mask=take, other=0.0,
                    eviction_policy="evict_first")
        acc = tl.where(take, acc + x.to(tl.float32), acc)
    tl.store(out_ptr + row * stride_out_m + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): 1024 columns per program (7168 = 7 x 1024), 8 elements (16 bytes bf16) per thread."""
    block_h = min(1024, next_pow2(hidden))
    return block_h, max(1, min(4, block_h // 256))


def masked_moe_sum(intermediate: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Triton masked reduction over top-k: intermediate [M, K, H], topk_ids [M, K] -> out [M, H]."""
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
    block_h, num_warps = sum_launch_config(H)
    grid = (M, triton.cdiv(H, block_h))
    _masked_moe_sum_kernel[grid](
        intermediate, topk_ids, out, H, intermediate.stride(0), intermediate.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        TOP_K=K, BLOCK_H=block_h, num_warps=num_warps)
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
