"""fp8 expert impls (target "kernel", NVTX stage "experts"):

  fused_experts.fp8                    fused_experts_fp8 on the rows prepare_moe_inputs stages (the point's
                                       group_size / scale_format), weights in 128x128 fp8 blocks
  fused_experts.fp8_oblivious          the pre-fix twin: -1 read as the last local expert

Inputs mirror fused_experts' cases: make_batch's hidden states routed by inputs.route, the router unmasked and the
padding mask applied by the staging (as the MegaMoE path does: padded rows leave it with -1 / 0.0), then rank 0's
expert map (non-local -> -1). Weights: make_expert_weights (the bf16 cases' seeded weights) quantised once and
cached. Every check runs the dequantised reference with the elementwise bound derived in fused_experts_fp8_ref.
Declared work is the useful work (valid routes), bytes at fp8 sizes, so roofline fractions compare with the bf16
cases'; the roofline is the fp8 one.

Outside fp8 implementations (the torch._scaled_grouped_mm peer in moebench.peers.torch_grouped) get this case
through `build_fp8_outside(make)`: the same inputs, bytes and routing, and the same reference and derived bound run
on the operands they declare they multiply (`Fp8Operands`), so a peer that re-quantises its inputs (row-wise
scales) is judged on its own inputs under the same bound, not a loosened one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from moebench.bench.experts import experts_info, oblivious_ids
from moebench.check import CheckResult, compare_close, poison
from moebench.inputs.weights import make_expert_weights
from moebench.kernels.runtime import interpreting
from moebench.kernels.apply_expert_map import apply_expert_map_torch, build_expert_map
from moebench.kernels.fp8_quant import ACT_GROUP, WEIGHT_BLOCK, quantize_weights_fp8_block, rowwise_weights
from moebench.kernels.fused_experts_fp8 import fp8_choice, fused_experts_fp8, make_fp8_workspace, x_scale_mode
from moebench.kernels.fused_experts_fp8_ref import (
    error_model,
    fp8_reference_with_bound,
    reference_from_dequantised,
)
from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs
from moebench.measure.cost import fused_experts_programs
from moebench.measure.roofline import roofline_us
from moebench.registry import Case, Routing, RunContext, declare_work, declared_work, register_impl


def check_within_bound(name: str, out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> CheckResult:
    """Elementwise |out - ref| <= bound (where the bound is 0, e.g. rows without a valid route, exact equality),
    reported with max / RMS relative errors against limits that are the bound's own max / RMS relative."""
    o, r, b = out.double().cpu(), ref.double().cpu(), bound.double().cpu()
    ref_max = r.abs().max().item() or 1.0
    ref_rms = r.pow(2).mean().sqrt().item() or 1.0
    max_limit, rms_limit = b.max().item() / ref_max, b.pow(2).mean().sqrt().item() / ref_rms
    res = compare_close(name, o, r, max_rel=max_limit, rms_rel=rms_limit)
    d = (o - r).abs().nan_to_num(float("inf"))
    over = d > b
    ratio = (d / b.clamp_min(1e-300)).where(b > 0, torch.where(d > 0, float("inf"), 0.0))
    res.metrics.update({f"{name}.bound_max_rel": max_limit, f"{name}.bound_rms_rel": rms_limit,
                        f"{name}.bound_ratio": float(ratio.max()) if ratio.numel() else 0.0})
    if bool(over.any()):
        first = [tuple(i.tolist()) for i in over.nonzero()[:5]]
        detail = f"{name}: {int(over.sum())}/{over.numel()} elements beyond the derived bound, first " + ", ".join(
            f"{i}: {o[i].item():.6g} vs {r[i].item():.6g} (bound {b[i].item():.3g})" for i in first)
        res = CheckResult(False, "; ".join(x for x in (res.detail, detail) if x), res.metrics)
    return res


_WEIGHTS: dict[tuple, tuple[torch.Tensor, ...]] = {}  # the last quantised weights (one set: 5.6 GB at full size)


def quantized_expert_weights(num_experts: int, hidden: int, intermediate: int, *, seed: int,
                             device: torch.device) -> tuple[torch.Tensor, ...]:
    """(w13_q, w13_scales, w2_q, w2_scales) of make_expert_weights' seeded weights, cached for the next point."""
    key = (num_experts, hidden, intermediate, seed, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        w13, w2 = make_expert_weights(num_experts, hidden, intermediate, seed=seed, device=device)
        w13_q, w13_s = quantize_weights_fp8_block(w13)
        del w13
        w2_q, w2_s = quantize_weights_fp8_block(w2)
        _WEIGHTS[key] = (w13_q, w13_s, w2_q, w2_s)
    return _WEIGHTS[key]


_ROWWISE: dict[tuple, tuple[torch.Tensor, ...]] = {}  # the last row-wise re-quantisation of those weights


def rowwise_expert_weights(num_experts: int, hidden: int, intermediate: int, *, seed: int,
                           device: torch.device) -> tuple[torch.Tensor, ...]:
    """(w13_q, w13_scales [E, 2I], w2_q, w2_scales [E, H]): quantized_expert_weights' blocks re-quantised with one
    scale per output channel (torch._scaled_grouped_mm's layout), cached for the next point (the peer and the
    ceiling share it)."""
    key = (num_experts, hidden, intermediate, seed, str(device))
    if key not in _ROWWISE:
        _ROWWISE.clear()
        w13_q, w13_s, w2_q, w2_s = quantized_expert_weights(num_experts, hidden, intermediate, seed=seed,
                                                            device=device)
        _ROWWISE[key] = (*rowwise_weights(w13_q, w13_s), *rowwise_weights(w2_q, w2_s))
    return _ROWWISE[key]


def _sample_rows(num_rows: int, work: float, device: torch.device, seed: int) -> torch.Tensor | None:
    """Rows the reference and its bound are computed on: all (None) when affordable, else a seeded sample (each
    output row depends only on its own staged row and routes)."""
    budget = 1.5e12 if device.type == "cuda" else 5e9
    if work <= budget:
        return None
    g = torch.Generator()
    g.manual_seed(seed + 99)
    n = max(64, int(num_rows * budget / work))
    return torch.randperm(num_rows, generator=g)[:n].sort().values.to(device)


def fp8_layout_problem(p) -> str | None:
    """Why the fp8 experts cannot take the point's shapes / staged layout, or None (the layer's fp8 experts too)."""
    if p.hidden % WEIGHT_BLOCK or p.intermediate % WEIGHT_BLOCK:
        return f"hidden / intermediate: fp8 experts need multiples of {WEIGHT_BLOCK} (128x128 weight blocks)"
    try:
        x_scale_mode(p.group_size, p.scale_format)
    except ValueError as e:
        return str(e)
    if p.scale_format == "ue8m0_packed" and p.hidden % (4 * p.group_size):
        return f"hidden: {p.hidden} is not a multiple of 4*group_size={4 * p.group_size} (ue8m0_packed)"
    return None


def _triton_available(ctx: RunContext) -> str | None:
    if ctx.is_cuda or interpreting():
        return None
    return "Triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"


@dataclass
class Fp8Inputs:
    """An fp8 point's inputs: the staged rows (the point's group_size / scale_format), the routes (rank 0's local
    ids, padded rows -1 when masked) and the block-quantised weights (cached: one set)."""

    batch: object  # moebench.inputs.batch.Batch
    x_q: torch.Tensor  # e4m3 [M, H]
    x_sf: torch.Tensor  # the staged scales
    group_size: int
    scale_format: str
    staged_ids: torch.Tensor  # [M, K] global ids after the staging
    ids: torch.Tensor  # int32 [M, K] local, -1 skipped
    topk_weights: torch.Tensor  # fp32 [M, K]
    w13_q: torch.Tensor
    w13_s: torch.Tensor
    w2_q: torch.Tensor
    w2_s: torch.Tensor


def fp8_inputs(p, ctx: RunContext) -> Fp8Inputs:
    from moebench.inputs import make_batch, route

    dev = ctx.device
    batch = make_batch(p, dev)
    router_w, global_ids = route(p, batch, use_mask=False)
    G, fmt = p.group_size, p.scale_format
    x_q, x_sf, staged_ids, topk_weights = prepare_moe_inputs(batch.hidden, router_w.float().contiguous(),
                                                             global_ids, batch.mask, G, fmt)
    E, H, I = p.local_experts, p.hidden, p.intermediate
    # rank 0 of an EP layout holding experts [0, E): non-local ids -> -1
    expert_map = build_expert_map(p.num_experts, local_experts=E, device=staged_ids.device)
    ids = apply_expert_map_torch(staged_ids, expert_map).to(torch.int32)
    w13_q, w13_s, w2_q, w2_s = quantized_expert_weights(E, H, I, seed=p.seed, device=dev)
    return Fp8Inputs(batch, x_q, x_sf, G, fmt, staged_ids, ids, topk_weights, w13_q, w13_s, w2_q, w2_s)


@dataclass(frozen=True)
class Fp8Operands:
    """What an outside fp8 implementation multiplies, dequantised to fp32, for the reference and its bound."""

    x: torch.Tensor  # fp32 [M, H]: its rows as it reads them
    w13_of: Callable[[int], torch.Tensor]  # expert e -> fp32 [2I, H]
    w2_of: Callable[[int], torch.Tensor]  # expert e -> fp32 [H, I]
    act_group: int  # columns per scale of its re-quantised SwiGLU output
    h_store_rel: float = 0.0  # rounding of its gate/up output before the SwiGLU (bf16: 2^-8)


# make(p, inputs) -> (fn(topk_ids, topk_weights, *, out) -> bf16 [M, H], the operands it multiplies)
OutsideFp8 = Callable[[object, Fp8Inputs], tuple[Callable[..., torch.Tensor], Fp8Operands]]


def build_fp8_outside(make: OutsideFp8):
    """The build of an outside fp8 experts implementation: this module's case around `make`'s function."""
    return lambda p, ctx: _build(p, ctx, "outside", outside=make)


def _build(p, ctx: RunContext, variant: str, outside: OutsideFp8 | None = None) -> Case:
    dev = ctx.device
    inp = fp8_inputs(p, ctx)
    batch, x_q, x_sf, staged_ids, ids, topk_weights = (inp.batch, inp.x_q, inp.x_sf, inp.staged_ids, inp.ids,
                                                       inp.topk_weights)
    w13_q, w13_s, w2_q, w2_s = inp.w13_q, inp.w13_s, inp.w2_q, inp.w2_s
    G, fmt = inp.group_size, inp.scale_format
    E, H, I = p.local_experts, p.hidden, p.intermediate
    M, K = ids.shape
    valid = (ids >= 0) & (ids < E)
    info = {**experts_info(ids, E), "expert_dtype": "fp8", "group_size": G, "scale_format": fmt}
    n_valid, experts_used = info["valid_routes"], info["experts_used"]
    tokens_read = int(valid.any(dim=1).sum())
    flops = 2 * n_valid * 3 * H * I
    bytes_moved = (experts_used * (3 * H * I + 3 * H * I // WEIGHT_BLOCK ** 2 * 4)
                   + tokens_read * (H + x_sf.shape[1] * 4)
                   + n_valid * (I + I // ACT_GROUP * 4) * 2 + n_valid * H * 2 * 2 + M * H * 2 + M * K * 8)
    note = ("fp8 weights (+ block scales) of experts with >=1 route + staged rows (+ scales) + fp8 act "
            "written+read + bf16 y written+read + out (useful routes only)")
    routing_ids = staged_ids  # global ids, padded rows -1 (when masked)
    out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    state: dict = {}
    graph_ok = True
    model = error_model(dev, H, I)

    if variant in ("triton", "oblivious"):
        ws = make_fp8_workspace(M, K, E, H, I, config=p.config if variant == "triton" else None, device=dev,
                                group_size=p.group_size, scale_format=p.scale_format)
        state["ws"] = ws
        info.update(ws.choice.record())
        info["config_detail"] = ws.config.short()
        run_ids = ids
        if variant == "oblivious":
            run_ids, remap, routing_ids = oblivious_ids(ids, routing_ids, E, info)

        def run():
            if variant == "oblivious":
                remap()
            return fused_experts_fp8(x_q, x_sf, run_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, group_size=G,
                                     scale_format=fmt, workspace=ws, out=out)

        def reference(check_ids, rows):
            sel = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            return fp8_reference_with_bound(sel(x_q), sel(x_sf), sel(check_ids), sel(topk_weights), w13_q, w13_s,
                                            w2_q, w2_s, group_size=G, scale_format=fmt, model=model)
    elif variant == "outside":
        fn, operands = outside(p, inp)
        info.update(getattr(fn, "info", None) or {})
        run_ids = ids
        outside_model = error_model(dev, H, I, h_store_rel=operands.h_store_rel)

        def run():
            return fn(ids, topk_weights, out=out)

        def reference(check_ids, rows):
            sel = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            return reference_from_dequantised(sel(operands.x), operands.w13_of, operands.w2_of, sel(check_ids),
                                              sel(topk_weights), E, act_group=operands.act_group,
                                              model=outside_model)
    else:  # pragma: no cover
        raise ValueError(variant)

    def check() -> CheckResult:
        poison(out)
        if "ws" in state:
            for t in (state["ws"].act, state["ws"].act_scales, state["ws"].y):
                poison(t)
        run()
        rows = _sample_rows(M, 3.0 * flops, dev, p.seed)
        ref, bound = reference(run_ids, rows)
        got = out if rows is None else out.index_select(0, rows)
        res = check_within_bound("out", got.float(), ref, bound)
        res.metrics["out.rows_checked"] = float(got.shape[0])
        checks = [res]
        if not torch.isfinite(out).all():
            checks.append(CheckResult(False, "out: non-finite (unwritten?) rows"))
        empty = ~((run_ids >= 0) & (run_ids < E)).any(dim=1)
        if bool(empty.any()) and bool((out[empty] != 0).any()):
            checks.append(CheckResult(False, "out: rows without a valid route are not zero"))
        if variant == "oblivious":
            masked = fused_experts_fp8(x_q, x_sf, ids, topk_weights, w13_q, w13_s, w2_q, w2_s, group_size=G,
                                       scale_format=fmt, workspace=state["ws"])
            diff = (out.float() - masked.float()).abs().amax(dim=1)
            corrupted = ~(diff <= 1e-2 * masked.float().abs().amax(dim=1))  # NaN counts as corrupted
            info["corrupted_rows"] = int(corrupted.sum())
            res.metrics["corrupted_rows"] = float(info["corrupted_rows"])
        return CheckResult.merge(*checks)

    def cleanup():
        state.clear()

    return Case(run=run, check=check, bytes_moved=bytes_moved, flops=flops, bytes_note=note,
                roofline_us=roofline_us(flops, bytes_moved, fp8=True),
                routing=Routing(routing_ids, batch.is_padding, p.num_experts, p.ep_size),
                graph_capturable=graph_ok, info=info, nvtx_stage="experts", cleanup=cleanup)


@register_impl("fused_experts.fp8", targets=("kernel",), available=_triton_available,
               validate=fp8_layout_problem, tuned_kernel="fused_experts_fp8",
               description="Triton fp8 grouped GEMMs on the staged rows: block-scaled gate/up + SwiGLU + "
                           "re-quantisation, down + top-k weight, slot sum")
def build_fp8(p, ctx: RunContext) -> Case:
    return _build(p, ctx, "triton")


@register_impl("fused_experts.fp8_oblivious", targets=("kernel",), available=_triton_available,
               validate=fp8_layout_problem,
               twin_of="fused_experts.fp8", description="pre-fix twin: -1 routes computed on the last local expert")
def build_fp8_oblivious(p, ctx: RunContext) -> Case:
    return _build(p, ctx, "oblivious")


def _interpreted_programs(p) -> float:
    """fused_experts_fp8's call in the interpreter: as the family's, its slot sum over the fp8 rule's wider block."""
    cfg = fp8_choice(p.num_tokens, p.top_k, p.local_experts, p.hidden, p.intermediate, "cpu",
                     group_size=p.group_size, scale_format=p.scale_format).config
    return fused_experts_programs(p, p.num_tokens, p.local_experts, cfg.reduce_block_h)


for _variant in ("fused_experts.fp8", "fused_experts.fp8_oblivious"):
    declare_work(_variant, replace(declared_work("fused_experts"), programs=_interpreted_programs))
