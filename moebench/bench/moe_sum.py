"""The top-k reduction bench family: masked_moe_sum (target "kernel", NVTX stage "reduce"), with NaN planted in
every skipped slot so that an implementation that loads one shows it."""

from __future__ import annotations

import torch

from moebench.check import CheckResult, compare_close, compare_exact, poison
from moebench.families import KernelFamily, register_family
from moebench.inputs import generator, make_batch, route
from moebench.kernels.masked_moe_sum import masked_moe_sum, masked_moe_sum_torch, moe_sum_oblivious, sum_choice
from moebench.measure.cost import PointWork, slot_sum_programs
from moebench.registry import Case, Routing, register_variants, declare_work

__all__ = ["compare_nan_aware", "compare_within_bf16_ulps", "input_dtype_sum_ulps", "oblivious_build_for"]


def compare_nan_aware(name: str, out: torch.Tensor, ref: torch.Tensor, max_rel: float, rms_rel: float):
    """NaN positions must match exactly; the finite elements are compared by max/RMS relative error."""
    out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
    nan_mismatch = int((out_nan != ref_nan).sum().item())
    finite = ~(out_nan | ref_nan)
    close = compare_close(name, out[finite], ref[finite], max_rel, rms_rel)
    ok = close.ok and nan_mismatch == 0
    detail = close.detail if nan_mismatch == 0 else f"{name}: NaN in {nan_mismatch} places the reference has none"
    return CheckResult(ok, "" if ok else detail, {**close.metrics, f"{name}.nan_mismatches": float(nan_mismatch)})


def input_dtype_sum_ulps(top_k: int) -> float:
    """The error bound, in bf16 ulps of sum(|x_k|), of a top_k sum whose running total is a bf16 (each of the
    top_k - 1 adds rounds by at most half an ulp of a partial sum no larger than sum(|x_k|)), measured against the
    fp32 sum rounded once to bf16 (another half ulp)."""
    return top_k / 2


def compare_within_bf16_ulps(name: str, out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor,
                             ulps: float) -> CheckResult:
    """NaN positions exact; every finite element within `ulps` bf16 ulps of `magnitude` (the scale of the rounding
    errors, e.g. sum(|x_k|)) of the reference. Reports the worst element in ulps."""
    out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
    nan_mismatch = int((out_nan != ref_nan).sum().item())
    finite = ~(out_nan | ref_nan)
    mag = magnitude.float()[finite]
    _, exponent = torch.frexp(mag)
    ulp = torch.where(mag > 0, torch.ldexp(torch.ones_like(mag), exponent - 8),
                      torch.full_like(mag, torch.finfo(torch.bfloat16).tiny))  # bf16 has 8 significant bits
    err = ((out.float()[finite] - ref.float()[finite]).abs() / ulp)
    worst = float(err.max().item()) if err.numel() else 0.0
    ok = nan_mismatch == 0 and worst <= ulps
    if nan_mismatch:
        detail = f"{name}: NaN in {nan_mismatch} places the reference has none"
    else:
        detail = "" if ok else f"{name}: {worst:.3g} bf16 ulps of sum(|x|) from the fp32 sum (limit {ulps:g})"
    return CheckResult(ok, detail, {f"{name}.max_ulps": worst, f"{name}.nan_mismatches": float(nan_mismatch)})


def _build_sum(variant: str, fn=None, input_dtype_accumulation: bool = False):
    """build(p, ctx) of a variant; "fn": `fn` called like the Triton sum; "fn_oblivious": `fn(intermediate, out=)`
    judged like the oblivious twin (every slot summed). input_dtype_accumulation: the outside sum may keep its
    running total in bf16, so it is judged by that precision class (compare_within_bf16_ulps) and flagged in the
    record instead of by the fp32 tolerances."""
    def build(p, ctx):
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

        if variant in ("oblivious", "fn_oblivious"):
            reduce = moe_sum_oblivious if variant == "oblivious" else fn

            def run():
                return reduce(intermediate, out=out)
            unmasked_ref = masked_moe_sum_torch(intermediate, torch.zeros_like(topk_ids))
            if input_dtype_accumulation:
                ulps = input_dtype_sum_ulps(K)
                info["precision"] = (f"bf16 accumulation allowed: within {ulps:g} bf16 ulps of sum(|x_k|) of the "
                                     "fp32 sum, not the fp32 tolerances")

            def check():
                poison(out)
                got = run()
                info["nan_rows"] = int(torch.isnan(got).any(dim=1).sum())  # rows the skipped slots poisoned
                if not input_dtype_accumulation:
                    return compare_nan_aware("out", got, unmasked_ref, 1e-2, 1e-3)
                magnitude = intermediate.float().abs().sum(dim=1)
                res = compare_within_bf16_ulps("out", got, unmasked_ref, magnitude, ulps)
                tight = compare_nan_aware("out", got, unmasked_ref, 1e-2, 1e-3)
                info["accumulation"] = ("fp32 (within the fp32 tolerances)" if tight.ok else
                                        "bf16 (outside the fp32 tolerances, inside the bf16 precision class)"
                                        if res.ok else "neither")
                return CheckResult(res.ok, res.detail, {**tight.metrics, **res.metrics})
            # Harm done: rows with a skipped slot whose output is not the masked result (bit for bit).
            got = reduce(intermediate, out=torch.empty_like(out))
            differs = (got.view(torch.int16) != ref.view(torch.int16)).any(dim=1)
            info["corrupted_rows"] = int((differs & skipped.any(dim=1)).sum().item())
            slots_read = T * K
        else:
            if variant == "fn":
                def run():
                    return fn(intermediate, topk_ids, out=out)
            elif variant == "torch":
                def run():
                    return masked_moe_sum_torch(intermediate, topk_ids, out=out)
            else:
                choice = sum_choice(T, K, H, ctx.device, p.config)  # what masked_moe_sum launches, recorded
                info.update(choice.record())

                def run():
                    return masked_moe_sum(intermediate, topk_ids, out=out, config=p.config)

            def check():
                poison(out)
                got = run()  # judged by what it returns (an outside sum may ignore `out`)
                info["nan_rows"] = int(torch.isnan(got).any(dim=1).sum())  # rows the skipped slots poisoned
                # fp32 accumulation in the same order: bitwise on a GPU; the CPU interpreter rounds fp32 -> bf16
                # differently, hence the tolerance. The exact-mismatch count is reported either way.
                res = compare_close("out", got, ref, 1e-2, 1e-2)
                exact = compare_exact("out", got, ref)
                return CheckResult(res.ok, res.detail, {**res.metrics, **exact.metrics})
            slots_read = int((~skipped).sum().item())

        elt = intermediate.element_size()
        return Case(run=run, check=check,
                    bytes_moved=slots_read * H * elt + T * H * elt + topk_ids.numel() * topk_ids.element_size(),
                    bytes_note="slots read (valid only when masked) + output written + ids",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size),
                    info=info, nvtx_stage="reduce")
    return build


_DESCRIPTIONS = {
    "triton": "Triton masked top-k sum (bf16 [T,K,H]); -1 slots are never loaded",
    "torch": "eager torch masked sum, fp32 accumulation in slot order (the reference)",
    "oblivious": "pre-fix torch.sum(dim=1): adds every slot, NaN/garbage in -1 slots reaches the output",
}
register_variants("masked_moe_sum", _DESCRIPTIONS, _build_sum, tuned_kernel="masked_moe_sum")


def oblivious_build_for(fn, *, input_dtype_accumulation: bool = False):
    """build(p, ctx) of an outside reduction that adds every slot (`fn(intermediate, out=) -> out`, e.g. vLLM's
    moe_sum): judged against the all-slots sum like masked_moe_sum.oblivious, with its harm counted.
    input_dtype_accumulation: judged by the bf16-accumulation precision class (recorded in info["precision"] and
    info["accumulation"]) for a sum that keeps its running total in bf16."""
    return _build_sum("fn_oblivious", fn, input_dtype_accumulation)


register_family(KernelFamily(
    "masked_moe_sum", ("kernel",), lambda fn: _build_sum("fn", fn),
    "fn(intermediate bf16 [T,K,H] (NaN in skipped slots), topk_ids int32 [T,K], out=bf16 [T,H]) -> bf16 [T,H]: "
    "the sum over slots with id >= 0"))


def _interpreted_programs(p) -> float:
    """The Triton variant's call in the interpreter: its kernel's grid as masked_moe_sum launches it on a CPU (the
    point's config, else the rule), padded rows' slots all -1 where the mask reaches them."""
    launch = sum_choice(p.num_tokens, p.top_k, p.hidden, "cpu", p.config).config
    return slot_sum_programs(p, p.num_tokens, launch, padded_rows=p.num_padding if p.mask else 0)


declare_work("masked_moe_sum", PointWork(call=lambda p: (p.num_tokens * p.top_k * p.hidden * 1.0,
                                                      p.num_tokens * p.hidden * (p.top_k * 2.0 + 2.0)),
                                        programs=_interpreted_programs, torch_variants=("oblivious",)))
