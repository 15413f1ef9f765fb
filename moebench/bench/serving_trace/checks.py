"""The serving_trace record's own consistency checks (moebench.consistency runs them before the record is written).

Each reads the typed record (trace_record.TraceRecord.from_info of the record's info) and names a figure by its path in
info. Against the definitions of the figures (headline.layer_headline for the single-rank view, ep_step.tax_split and
ep_step.step_totals for the EP step): per side, the layer over the trace is its real-only time plus its time on padding,
the tax is that share, the masks' recovery is the difference of the two layers; a trace with no padded row has no
time, GEMM row or EP tax on padding; the shares are within [0, 1] and the counts not negative; the EP step's tax
split adds up to its total, which is the difference of the two steps, and without DBO nothing overlaps.
"""

from __future__ import annotations

from typing import Iterable

from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.trace_record import TraceRecord
from moebench.consistency import close, register_check

HEAD = "info.headline"


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _record(record: dict) -> TraceRecord | None:
    info = record.get("info")
    return TraceRecord.from_info(info) if isinstance(info, dict) and isinstance(info.get("headline"), dict) else None


@register_check("serving_trace")
def single_rank_totals(record: dict) -> Iterable[str]:
    """layer_us = real_only_us + padding_us, padding_tax = padding_us / layer_us, recovered_us = the difference."""
    rec = _record(record)
    if rec is None:
        return
    head = rec.headline
    layer, real, padding, tax = (head.layer_us or {}, head.real_only_us or {}, head.padding_us or {},
                                 head.padding_tax or {})
    for side in SIDES:
        total, a, b = layer.get(side), real.get(side), padding.get(side)
        if _num(total) and _num(a) and _num(b) and not close(total, a + b, terms=3):
            yield f"{HEAD}.layer_us.{side}: {total} != real_only_us + padding_us = {a + b}"
        share = tax.get(side)
        if _num(share) and _num(total) and _num(b) and total and abs(share - b / total) > 1e-6:
            yield f"{HEAD}.padding_tax.{side}: {share} != padding_us / layer_us = {b / total}"
    if _num(head.recovered_us) and all(_num(layer.get(s)) for s in SIDES):
        diff = layer["oblivious"] - layer["masked"]
        if not close(head.recovered_us, diff, terms=3):
            yield f"{HEAD}.recovered_us: {head.recovered_us} != layer_us oblivious - masked = {diff}"


@register_check("serving_trace")
def no_padding_no_tax(record: dict) -> Iterable[str]:
    """A trace whose steps pad no row spends nothing on padding, on either side and in the EP step."""
    rec = _record(record)
    if rec is None or rec.headline.padded_rows != 0:
        return
    head = rec.headline
    for what, figures in (("padding_us", head.padding_us), ("padding_gemm_rows", head.padding_gemm_rows)):
        for side, v in (figures or {}).items():
            if _num(v) and v != 0:
                yield f"{HEAD}.{what}.{side}: {v} with no padded row in the trace"
    total = (head.ep_step.tax_split_us or {}).get("total_us") if head.ep_step is not None else None
    if _num(total) and not close(total, 0.0):
        yield f"{HEAD}.ep_step.tax_split_us.total_us: {total} with no padded row in the trace"


@register_check("serving_trace")
def shares_and_counts(record: dict) -> Iterable[str]:
    """Shares within [0, 1]; row, route and compile counts not negative."""
    rec = _record(record)
    if rec is None:
        return
    head = rec.headline
    shares = {f"{HEAD}.padding_row_share": head.padding_row_share,
              f"{HEAD}.ep_step.slowest_rank_padded_route_share":
                  head.ep_step.slowest_rank_padded_route_share if head.ep_step is not None else None}
    for path, v in shares.items():
        if _num(v) and not 0.0 <= v <= 1.0:
            yield f"{path}: {v} is not a share (within [0, 1])"
    for what, v in (("real_tokens", head.real_tokens), ("padded_rows", head.padded_rows)):
        if _num(v) and v < 0:
            yield f"{HEAD}.{what}: {v} is negative"
    for what in ("padding_gemm_rows", "ep_excess_routes", "jit_compiles"):
        for side, v in (getattr(head, what) or {}).items():
            if _num(v) and v < 0:
                yield f"{HEAD}.{what}.{side}: {v} is negative"


@register_check("serving_trace")
def ep_step_totals(record: dict) -> Iterable[str]:
    """The EP tax split adds up to total_us, the step difference; per side the wire is dispatch + combine, the
    slowest rank is not faster than the mean one, and without DBO the step is experts + wire."""
    rec = _record(record)
    if rec is None or rec.headline.ep_step is None or not isinstance(rec.headline.ep_step.tax_split_us, dict):
        return
    split, steps = rec.headline.ep_step.tax_split_us, rec.headline.ep_step.step_us or {}
    parts = [split.get(k) for k in ("gemm_us", "straggler_us", "wire_us", "overlap_us")]
    total = split.get("total_us")
    if all(_num(v) for v in parts) and _num(total) and not close(total, sum(parts), terms=5):
        yield f"{HEAD}.ep_step.tax_split_us.total_us: {total} != gemm + straggler + wire + overlap = {sum(parts)}"
    if _num(total) and all(_num(steps.get(s)) for s in SIDES):
        diff = steps["oblivious"] - steps["masked"]
        if not close(total, diff, terms=3):
            yield f"{HEAD}.ep_step.tax_split_us.total_us: {total} != step_us oblivious - masked = {diff}"
    dbo = (rec.engine or {}).get("dbo")
    # the overlap is the residual of sums over the whole trace: its rounding scales with the steps' sums
    scale = max((abs(v) for v in steps.values() if _num(v)), default=0.0)
    if dbo is False and _num(split.get("overlap_us")) and not (
            close(split["overlap_us"], 0.0, terms=5) or abs(split["overlap_us"]) <= 1e-9 * scale):
        yield f"{HEAD}.ep_step.tax_split_us.overlap_us: {split['overlap_us']} without DBO (nothing overlaps)"
    totals = (rec.ep_step.totals if rec.ep_step is not None else None) or {}
    for side in SIDES:
        t = totals.get(side) or {}
        if not all(_num(t.get(k)) for k in ("step_us", "experts_us", "mean_rank_us", "dispatch_us", "combine_us")):
            continue
        if t["experts_us"] < t["mean_rank_us"] - 0.002:
            yield f"info.ep_step.totals.{side}.experts_us: {t['experts_us']} below the mean rank's {t['mean_rank_us']}"
        wire = t["dispatch_us"] + t["combine_us"]
        if dbo is False and not close(t["step_us"], t["experts_us"] + wire, terms=4):
            yield (f"info.ep_step.totals.{side}.step_us: {t['step_us']} != experts + dispatch + combine = "
                   f"{t['experts_us'] + wire}")
