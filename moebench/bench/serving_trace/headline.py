"""The headlines of a serving trace: the single-rank view over the trace (TraceHeadline, with how far the timings'
noise could move its figures) and the EP step's (EPHeadline), each distinct step weighted by how often it occurs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from moebench.bench.serving_trace.record import SIDES, EPHeadline, EPStepRecord, TraceHeadline
from moebench.bench.serving_trace.steps import StepFigures, step_percentiles
from moebench.params import Params


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def layer_headline(tot: dict[str, dict[str, float]]) -> dict[str, object]:
    """The run's headline figures from the trace totals: the padding tax per side (time on padded rows over the
    layer's time), and what the masks recover (oblivious minus masked time, absolute and as a share of the
    oblivious padding time)."""
    layer, padding = tot["layer_us"], tot["padding_us"]
    recovered = layer["oblivious"] - layer["masked"]
    return {"layer_us": dict(layer), "real_only_us": dict(tot["real_only_us"]), "padding_us": dict(padding),
            "padding_tax": {side: share(padding[side], layer[side]) for side in SIDES},
            "recovered_us": recovered, "recovered_share": share(recovered, padding["oblivious"])}


def trace_headline(p: Params, steps: StepFigures, counts, tot: dict, calls: Counter, figures: dict,
                   ep_step: EPStepRecord | None = None, spread_of=None) -> TraceHeadline:
    """The single-rank headline over the trace (each distinct step weighted by how often it occurs), its noise, and
    the EP step's headline where the point has one."""
    head = layer_headline(tot)
    w = np.asarray(counts, dtype=np.int64)
    real_rows = int((w * steps.calls.real_tokens.sum(axis=1)).sum())
    padded = int((w * steps.calls.padded_rows()).sum())
    head.update(view="single_rank: this EP rank's layer over its own calls (router, align, its local experts, "
                     "reduce); no straggler, no wire",
                real_tokens=real_rows, padded_rows=padded,
                padding_row_share=padded / (padded + real_rows) if padded + real_rows else None,
                padding_gemm_rows={s: int((w * steps.padding_gemm_rows[s]).sum()) for s in SIDES},
                ep_excess_routes={s: steps.weighted(steps.ep_excess_routes[s], w) for s in SIDES})
    head["ep_excess_from_padding"] = head["ep_excess_routes"]["oblivious"] - head["ep_excess_routes"]["masked"]
    if p.ep_size > 1:
        head["jit_compiles"] = {s: steps.distinct_capacities(s) for s in SIDES}
    else:
        head["jit_compiles"] = {s: None for s in SIDES}  # one rank: no dispatch to size
    ep = ep_headline(ep_step) if ep_step is not None else None
    if ep is not None and steps.ep is not None:
        ep.step_percentiles_us = {s: step_percentiles(steps.ep.sides[s]["step_us"], w) for s in SIDES}
    return TraceHeadline(**head, noise=noise(calls, figures, tot, spread_of), ep_step=ep,
                         step_percentiles_us={s: step_percentiles(steps.layer_us[s], w) for s in SIDES})


def noise(calls: Counter, figures: dict, tot: dict, spread_of=None) -> dict[str, Any]:
    """How far the trace's padding time and the masks' saving could move with the timings' spread: per shape, half
    its samples' p10-p90 spread times the calls that read it (one shape's error repeats in every call of it),
    summed in quadrature over shapes (their errors are independent); a conservative bound (the p50's own error is
    smaller than the samples' spread). A padded call's padding time reads its shape and its real tokens alone (an
    unpadded call's is exactly 0); the saving reads every call's shape on both sides. A shape the cost model read
    (not timed) carries `spread_of(shape)`: the model's held-out error on its time. None where a shape has no
    spread (too few samples, or not timed and no model error)."""
    padding_reads: Counter = Counter()
    for (rows, real), n in calls.items():
        if rows != real:
            padding_reads[(rows, real)] += n
            if real:
                padding_reads[(real, real)] += n

    def spread(shape):
        got = ((figures.spread_us(shape) if hasattr(figures, "spread_us") else figures[shape].layer_spread_us)
               if shape in figures else {})
        if not got and spread_of is not None:
            got = spread_of(shape) or {}
        return None if any(got.get(side) is None for side in SIDES) else got

    if any(spread(s) is None for s in set(padding_reads) | set(calls)):
        return {"padding_us": {side: None for side in SIDES}, "recovered_us": None,
                "within_noise": {"padding_tax": {side: None for side in SIDES}, "recovered": None}}
    pad = {side: sum((n * spread(s)[side]) ** 2 for s, n in padding_reads.items()) ** 0.5 for side in SIDES}
    rec = sum((n * spread(s)[side]) ** 2 for s, n in calls.items() for side in SIDES) ** 0.5
    recovered = tot["layer_us"]["oblivious"] - tot["layer_us"]["masked"]
    return {"padding_us": {side: round(v, 3) for side, v in pad.items()}, "recovered_us": round(rec, 3),
            "within_noise": {"padding_tax": {side: abs(tot["padding_us"][side]) <= pad[side] for side in SIDES},
                             "recovered": abs(recovered) <= rec}}


def ep_headline(ep: EPStepRecord) -> EPHeadline:
    """The EP step's headline: step time per side, the tax of padding and its split, the straggler wait."""
    tot, tax = ep.totals, ep.tax
    step = {s: tot[s]["step_us"] for s in SIDES}
    return EPHeadline(
        step_us=step, experts_us={s: tot[s]["experts_us"] for s in SIDES},
        mean_rank_us={s: tot[s]["mean_rank_us"] for s in SIDES}, straggler_wait_us=tax["straggler_wait_us"],
        wire_us={s: round(tot[s]["dispatch_us"] + tot[s]["combine_us"], 3) for s in SIDES},
        dispatch_us={s: tot[s]["dispatch_us"] for s in SIDES}, combine_us={s: tot[s]["combine_us"] for s in SIDES},
        padding_tax=share(tax["total_us"], step["oblivious"]),
        tax_split_us={k: tax[k] for k in ("gemm_us", "straggler_us", "wire_us", "overlap_us", "total_us")},
        slowest_rank_padded_route_share=ep.slowest_rank_padded_route_share, rank_times=ep.rank_times)
