"""What the report says of a figure that the timings cannot tell from zero, or whose two sides are not comparable.

A serving_trace record states, per figure, whether it lies inside the timings' spread
(info.headline.noise.within_noise: padding_tax per side, recovered; None where the shapes were timed with too few
samples to know). Every place that prints such a figure (the headlines, the report page, compare) reads the verdict
here, so `within noise` is said everywhere or nowhere. A masked/oblivious pair whose masked layer is slower than
the oblivious one on the real rows alone (the two sides' own speeds differ, as the interpreter's do) is not
comparable: a tax or a recovery computed from it would read as a saving, so it is named instead of a ratio.
"""

from __future__ import annotations

import json
import math
from typing import Any

from moebench.records import SIDES

HEAD = "info.headline."
# the noise verdict (a path under info.headline.noise.within_noise) of each figure under info.headline
VERDICT_OF = {"padding_tax": "padding_tax", "padding_us": "padding_tax", "recovered_us": "recovered",
              "recovered_share": "recovered"}
# the figures that compare the masked side with the oblivious one (not comparable when the sides' speeds differ)
PAIRED = ("padding_tax", "padding_us", "recovered_us", "recovered_share", "layer_us")
# the keys of a trace step (info.trace_steps) that say which rows it ran: two sides with equal ones ran the same
# steps, whatever their seeded routing made of them
STEP_ROWS = ("real", "cudagraph_rows", "dp_rows", "micro_batch_rows", "sp_rows", "chunk_rows", "calls", "rows",
             "padded_rows", "added_rows")
UNKNOWN_NOISE_SLACK = 0.05  # where the noise is unknown, masked real-only time more than 5% above oblivious


def _at(node: Any, *path: str) -> Any:
    for k in path:
        node = node.get(k) if isinstance(node, dict) else None
    return node


def _figure(metric: str) -> tuple[str, str | None] | None:
    """(figure, side) of a metric path under info.headline (`info.headline.padding_tax.masked`), else None."""
    if not metric.startswith(HEAD):
        return None
    parts = metric[len(HEAD):].split(".")
    return parts[0], (parts[1] if len(parts) > 1 and parts[1] in SIDES else None)


def within_noise(record: dict, metric: str) -> bool | None:
    """The record's verdict on the figure at `metric`: True inside the timings' spread, False outside, None unknown
    (or a figure without a verdict)."""
    fig = _figure(metric)
    if fig is None or fig[0] not in VERDICT_OF:
        return None
    verdict = _at(record, "info", "headline", "noise", "within_noise", VERDICT_OF[fig[0]])
    if isinstance(verdict, dict):
        verdict = verdict.get(fig[1]) if fig[1] else None
    return verdict if isinstance(verdict, bool) else None


def not_comparable(record: dict) -> str | None:
    """Why the record's masked and oblivious sides are not comparable (the masked layer slower on the real rows
    alone, beyond the noise; 5% where the noise is unknown), or None."""
    real = _at(record, "info", "headline", "real_only_us") or {}
    masked, oblivious = real.get("masked"), real.get("oblivious")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (masked, oblivious)) or oblivious <= 0:
        return None
    bound = _at(record, "info", "headline", "noise", "recovered_us")
    slack = bound if isinstance(bound, (int, float)) else UNKNOWN_NOISE_SLACK * oblivious
    if masked - oblivious <= slack:
        return None
    return (f"not comparable: the masked layer is slower on the real rows alone ({masked / 1e3:.2f} vs "
            f"{oblivious / 1e3:.2f} ms)")


def model_note(records: list[dict], metric: str) -> str:
    """The model's word on a serving_trace figure a model made: `±4.8% model` where the model (or the replay that
    checks it) states an error, `model unchecked` where nothing does, "" for a figure read off timings alone and
    for any other figure. The EP step's figures (`info.headline.ep_step.*`: the rank model,
    EPStepRecord.model_error) and the layer's (`info.headline.layer_us.<side>`: the shape model); the first
    selected record that holds the figure speaks."""
    from moebench.bench.serving_trace.trace_record import TraceRecord

    fig = _figure(metric)
    if fig is None or fig[0] not in ("ep_step", "layer_us"):
        return ""
    side = metric.rsplit(".", 1)[-1]
    side = side if side in SIDES else None
    for r in records:
        info = r.get("info") or {}
        if r.get("target") != "serving_trace" or not isinstance(info.get("headline"), dict):
            continue
        if fig[0] == "ep_step":
            if not isinstance(info.get("ep_step"), dict):
                continue
            error = TraceRecord.from_info(info).ep_step_error(side)[0]
        elif side is None:
            continue
        else:
            error = TraceRecord.from_info(info).layer_error(side)[0]
        return "model unchecked" if error is None else ("" if error == 0 else f"±{error:.1%} model")
    return ""


def metric_note(records: list[dict], metric: str) -> str:
    """`within noise` when a selected record says the figure is inside its noise, else ""."""
    return "within noise" if any(within_noise(r, metric) for r in records) else ""


def pair_note(records: list[dict], metric: str, with_metric: str) -> str:
    """For a headline that sets a figure's oblivious side against its masked side (metric and with_metric), the
    not-comparable reason of the first selected record it applies to; else ""."""
    fig, other = _figure(metric), _figure(with_metric)
    if fig is None or other is None or fig[0] not in PAIRED or fig[0] != other[0] or fig[1] == other[1]:
        return ""
    for r in records:
        why = not_comparable(r)
        if why:
            return why
    return ""


def same_steps(records_a: list[dict], records_b: list[dict]) -> bool:
    """Whether two selections ran the very same trace steps, padding included (two distributions cut to the same
    decode steps at a CPU size, two capture lists that pad a short trace alike): their comparison then measures
    nothing but the timings' noise and the seeded routing."""
    def shape(step: dict) -> dict:  # the step's rows, not what they took nor where its routing went
        return {k: step.get(k) for k in STEP_ROWS} if isinstance(step, dict) else step

    def steps(records):  # None unless every record keeps its steps as a list (jit_trace's is a count)
        kept = [_at(r, "info", "trace_steps") for r in records]
        if not kept or not all(isinstance(k, list) and k and all(isinstance(s, dict) for s in k) for k in kept):
            return None
        return [json.dumps([shape(s) for s in k], sort_keys=True, default=str) for k in kept]
    a, b = steps(records_a), steps(records_b)
    return a is not None and a == b


def ratio_within_noise(ratio: float, cv_a: Any, cv_b: Any, sigmas: float = 2.0) -> bool:
    """Whether a B/A ratio is inside the two points' own spread (cv as fractions): |ln ratio| <= sigmas x their
    combined cv."""
    if not (isinstance(ratio, (int, float)) and ratio > 0 and all(isinstance(c, (int, float)) for c in (cv_a, cv_b))):
        return False
    return abs(math.log(ratio)) <= sigmas * math.hypot(cv_a, cv_b)
