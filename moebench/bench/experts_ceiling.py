"""The GEMM ceiling beside fused_experts: the two expert GEMMs alone through torch's grouped GEMMs, rows already
sorted by expert, nothing else (no sort, no SwiGLU, no combine), on the point's own routing and on equal groups:

  fused_experts.ceiling            bf16 torch._grouped_mm, gate/up then down, on the point's own group sizes
  fused_experts.ceiling_equal      the same rows in equal groups (their total split as evenly as E allows)
  fused_experts.fp8_ceiling        fp8 torch._scaled_grouped_mm (row-wise scales), the point's own group sizes
  fused_experts.fp8_ceiling_equal  the same in equal groups

  layer.ceiling / layer.ceiling_equal  the same beside the single-GPU layer (target layer), bf16 or fp8 by the
                                       point's expert_dtype, on the masked layer's routing

They are registered with ceiling=True: no peer (report.peers leaves them out), and report.ceiling gives every
record at the same point (kernel family and parameters) of the same expert dtype (info["expert_dtype"]) its
fraction_of_ceiling = ceiling p50 / its p50, and the point its uneven_cost = own-routing / equal-group ceiling:
what partial row tiles of uneven experts cost every grouped GEMM.

Inputs are the families' own (bench.experts.experts_inputs, bench.experts_fp8.fp8_inputs), so the group sizes are
those of the records beside them: the valid routes' per-expert counts (skipped routes, -1 or non-local, are no
GEMM work and sit past the last group end). The A operand has the static T*K rows of the peers; its sorted rows,
the SwiGLU output the down GEMM reads (made once, from the gate/up GEMM) and the offsets are built here; run() is
the two GEMM calls. fp8 operands are the row-wise re-quantisations the torch peer multiplies. torch allocates the
outputs (no out= to poison): the check runs the GEMMs and compares each one's rows inside the groups with the
plain-torch definition (bench.torch_grouped_gemm), on a seeded sample of rows, and requires them finite.
Declared work: 2 * rows * 3*H*I FLOPs; bytes: the weights of every non-empty group, the A rows (+ scales), the
gate/up output written, the SwiGLU output read, the down output written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moebench.bench.experts import equal_rows, expert_rows, experts_inputs, row_tiles
from moebench.bench.experts_fp8 import fp8_inputs, fp8_layout_problem, rowwise_expert_weights
from moebench.bench.torch_grouped_gemm import (
    TORCH_GEMMS,
    GroupedGemms,
    grouped_mm_problem,
    grouped_mm_unavailable,
    scaled_grouped_mm_unavailable,
)
from moebench.check import CheckResult, compare_close
from moebench.kernels.fp8_quant import requantize_per_row, rowwise_rows
from moebench.measure.roofline import roofline_us
from moebench.registry import Case, Routing, RunContext, register_impl

__all__ = ["group_sizes", "sorted_tokens", "GROUPS", "build_ceiling"]

GROUPS = ("routed", "equal")
SAMPLE_ROWS = 256  # rows per GEMM compared with the fp32 definition


def group_sizes(ids: torch.Tensor, num_experts: int, groups: str) -> torch.Tensor:
    """int64 [E]: the valid routes per expert ("routed"), or their total split as evenly as E groups allow."""
    counts = expert_rows(ids, num_experts)
    return counts if groups == "routed" else equal_rows(int(counts.sum()), num_experts, ids.device)


def sorted_tokens(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [M*K]: the token of each route, valid routes first in expert order (stable), skipped routes last."""
    flat = ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    return torch.sort(key, stable=True).indices // ids.shape[1]


def _sample(n: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed + 7)
    return torch.randperm(n, generator=g)[:SAMPLE_ROWS].sort().values.to(device)


def _check_gemm(name: str, got: torch.Tensor, a_of, b_of, offs: torch.Tensor, rows: torch.Tensor) -> CheckResult:
    """got[rows] against the fp32 product of each sampled row with its group's weight (a_of(rows), b_of(g))."""
    if rows.numel() == 0:
        return CheckResult(True, "", {f"{name}.rows_checked": 0.0})  # no valid route: neither GEMM has work
    group = torch.searchsorted(offs.long(), rows, right=True)
    a = a_of(rows)
    ref = torch.empty(rows.numel(), got.shape[1], dtype=torch.float32, device=got.device)
    for g in torch.unique(group).tolist():
        sel = group == g
        ref[sel] = a[sel] @ b_of(g)
    sub = got.index_select(0, rows).float()
    res = compare_close(name, sub, ref, max_rel=2e-2, rms_rel=1e-2)
    if not bool(torch.isfinite(sub).all()):
        res = CheckResult(False, f"{name}: non-finite rows inside the groups", res.metrics)
    res.metrics[f"{name}.rows_checked"] = float(rows.numel())
    return res


class _Groups(NamedTuple):
    counts: torch.Tensor  # int64 [E]: rows per group
    offs: torch.Tensor  # int32 [E]: the group ends the grouped GEMMs take
    n: int  # rows inside the groups
    used: int  # non-empty groups (whose weights are read)


def _grouping(ids: torch.Tensor, num_experts: int, groups: str) -> _Groups:
    counts = group_sizes(ids, num_experts, groups)
    return _Groups(counts, counts.cumsum(0).to(torch.int32), int(counts.sum()), int((counts > 0).sum()))


def _check_both(run, g: _Groups, seed: int, device: torch.device, gate_up: tuple, down: tuple):
    """The check of run() -> (gate/up out, down out): each GEMM's sampled rows against its fp32 definition;
    gate_up and down are each (a_of, b_of) of _check_gemm."""
    def check() -> CheckResult:
        h_got, y_got = run()
        sample = _sample(g.n, seed, device)
        return CheckResult.merge(_check_gemm("gate_up", h_got, *gate_up, g.offs, sample),
                                 _check_gemm("down", y_got, *down, g.offs, sample))
    return check


def _case(p, g: _Groups, groups: str, routing: Routing, run, check, nbytes: int, fp8: bool, info: dict) -> Case:
    counts = g.counts
    mean = float(counts.float().mean()) if counts.numel() else 0.0
    info.update({"groups": groups, "rows": g.n, "experts_used": g.used, "row_tiles": row_tiles(counts),
                 "group_max_over_mean": float(counts.max()) / mean if mean > 0 else 0.0})
    note = ("weights of non-empty groups + A rows (+ scales) + gate/up out written + SwiGLU out read + down out "
            "written (the GEMMs alone)")
    flops = 2 * g.n * 3 * p.hidden * p.intermediate
    return Case(run=run, check=check, flops=flops, bytes_moved=nbytes, bytes_note=note,
                roofline_us=roofline_us(flops, nbytes, fp8=fp8), routing=routing if groups == "routed" else None,
                graph_capturable=True, info=info, nvtx_stage="experts")


def _build_bf16(p, ctx: RunContext, groups: str, gemms: GroupedGemms) -> Case:
    inp = experts_inputs(p, ctx)
    E, I = p.local_experts, p.intermediate
    g = _grouping(inp.ids, E, groups)
    offs, n = g.offs, g.n
    rows = inp.x.index_select(0, sorted_tokens(inp.ids, E))
    w13_t, w2_t = inp.w13.transpose(-2, -1), inp.w2.transpose(-2, -1)
    gemm = gemms.grouped_mm
    h = gemm(rows, w13_t, offs=offs)
    act = (F.silu(h[:, :I].float()) * h[:, I:].float()).to(torch.bfloat16)
    act[n:] = 0  # rows past the last group: never read, made finite anyway
    del h

    def run():
        return gemm(rows, w13_t, offs=offs), gemm(act, w2_t, offs=offs)

    check = _check_both(run, g, p.seed, rows.device,
                        gate_up=(lambda r: rows.index_select(0, r).float(), lambda e: w13_t[e].float()),
                        down=(lambda r: act.index_select(0, r).float(), lambda e: w2_t[e].float()))
    H = p.hidden
    nbytes = g.used * 3 * H * I * 2 + n * (H * 2 + 2 * I * 2 + I * 2 + H * 2)
    routing = Routing(inp.global_ids, inp.batch.is_padding, p.num_experts, p.ep_size)
    return _case(p, g, groups, routing, run, check, nbytes, False, {"expert_dtype": "bf16"})


def _build_fp8(p, ctx: RunContext, groups: str, gemms: GroupedGemms) -> Case:
    inp = fp8_inputs(p, ctx)
    E, I = p.local_experts, p.intermediate
    g = _grouping(inp.ids, E, groups)
    offs, n = g.offs, g.n
    w13_q, w13_s, w2_q, w2_s = rowwise_expert_weights(E, p.hidden, I, seed=p.seed, device=ctx.device)
    x_q, x_s = rowwise_rows(inp.x_q, inp.x_sf, inp.group_size, inp.scale_format)
    token = sorted_tokens(inp.ids, E)
    rows, row_scales = x_q.view(torch.uint8).index_select(0, token).view(x_q.dtype), x_s.index_select(0, token)
    w13_t, w2_t = w13_q.transpose(-2, -1), w2_q.transpose(-2, -1)
    gemm = gemms.scaled_grouped_mm
    h = gemm(rows, w13_t, row_scales, w13_s, offs=offs, out_dtype=torch.bfloat16)
    a = F.silu(h[:, :I].float()) * h[:, I:].float()
    a[n:] = 0  # rows past the last group: never read, made finite anyway
    act_q, act_s = requantize_per_row(a)
    del h, a

    def run():
        return (gemm(rows, w13_t, row_scales, w13_s, offs=offs, out_dtype=torch.bfloat16),
                gemm(act_q, w2_t, act_s, w2_s, offs=offs, out_dtype=torch.bfloat16))

    check = _check_both(run, g, p.seed, rows.device,
                        gate_up=(lambda r: rows.index_select(0, r).float() * row_scales[r][:, None],
                                 lambda e: w13_t[e].float() * w13_s[e][None, :]),
                        down=(lambda r: act_q.index_select(0, r).float() * act_s[r][:, None],
                              lambda e: w2_t[e].float() * w2_s[e][None, :]))
    H = p.hidden
    nbytes = g.used * (3 * H * I + (2 * I + H) * 4) + n * (H + 4 + 2 * I * 2 + I + 4 + H * 2)
    routing = Routing(inp.staged_ids, inp.batch.is_padding, p.num_experts, p.ep_size)
    return _case(p, g, groups, routing, run, check, nbytes, True,
                 {"expert_dtype": "fp8", "group_size": inp.group_size, "scale_format": inp.scale_format})


def build_ceiling(expert_dtype: str, groups: str, gemms: GroupedGemms = TORCH_GEMMS):
    """The build of one ceiling impl (gemms: torch's, or their plain-torch loop in the CPU tests of fp8)."""
    make = _build_bf16 if expert_dtype == "bf16" else _build_fp8
    return lambda p, ctx: make(p, ctx, groups, gemms)


_TEXT = {"routed": "the point's own group sizes", "equal": "the same rows in equal groups"}


def _layer_available(ctx: RunContext) -> str | None:
    return grouped_mm_unavailable(ctx.device) or scaled_grouped_mm_unavailable(ctx.device)


def _layer_problem(p) -> str | None:
    return fp8_layout_problem(p) if p.expert_dtype == "fp8" else grouped_mm_problem(p)


def _layer_build(groups: str):
    return lambda p, ctx: build_ceiling(p.expert_dtype, groups)(p, ctx)


for _groups in GROUPS:
    _tail = "" if _groups == "routed" else "_equal"
    register_impl(f"fused_experts.ceiling{_tail}", targets=("kernel",), ceiling=True,
                  available=lambda ctx: grouped_mm_unavailable(ctx.device), validate=grouped_mm_problem,
                  description=f"ceiling: torch._grouped_mm gate/up + down alone on rows sorted by expert, "
                              f"{_TEXT[_groups]}")(build_ceiling("bf16", _groups))
    register_impl(f"fused_experts.fp8_ceiling{_tail}", targets=("kernel",), ceiling=True,
                  available=lambda ctx: scaled_grouped_mm_unavailable(ctx.device), validate=fp8_layout_problem,
                  description=f"ceiling: torch._scaled_grouped_mm (row-wise fp8) gate/up + down alone, "
                              f"{_TEXT[_groups]}")(build_ceiling("fp8", _groups))
    # the layer's: its expert_dtype picks the GEMMs, so both must run here (a sweep mixes the dtypes)
    register_impl(f"layer.ceiling{_tail}", targets=("layer",), ceiling=True, available=_layer_available,
                  validate=_layer_problem,
                  description=f"ceiling beside the layer: torch's grouped GEMMs (the point's expert_dtype) alone, "
                              f"{_TEXT[_groups]}")(_layer_build(_groups))
