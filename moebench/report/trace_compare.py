"""`moebench compare` on serving_trace runs: the trace's answers, not one shape's p50.

For every serving_trace point present in both runs (matched by key: impl and every parameter), per side: the EP
step over the trace (where the point has EP ranks) and this rank's layer over the trace, A and B and B / A, each
with the error its model states (report.ranking: a rank or shape model's held-out error, 0 where everything was
timed, `unchecked` where its model has none), and the padding tax both ways. A change no larger than the two
figures' errors added reads `within the errors`; a figure read off timings carries the timings' spread (the
headline's noise bound) as its error; with a model unchecked, or the timings' noise unknown (the interpreter's few
samples), the change is stated but not judged. A layer tax the run calls not comparable is said so.
"""

from __future__ import annotations

from moebench.bench.serving_trace.trace_record import TraceRecord
from moebench.records import SIDES
from moebench.report import cells, noise
from moebench.report.ranking import Figure, ep_figure, layer_figure, with_timing_noise


def _pairs(records_a: list[dict], records_b: list[dict]) -> list[tuple[dict, dict]]:
    def traces(records):
        return {r["key"]: r for r in records if r.get("target") == "serving_trace" and r.get("status") == "ok"
                and isinstance((r.get("info") or {}).get("headline"), dict) and "key" in r}
    a, b = traces(records_a), traces(records_b)
    return [(a[k], b[k]) for k in b if k in a]


def _verdict(fa: Figure, fb: Figure) -> str:
    if fa.rel_error is None or fb.rel_error is None:
        return "not judged: " + (fa.error_source if fa.rel_error is None else fb.error_source)
    bound = fa.rel_error * fa.us + fb.rel_error * fb.us
    return "within the errors" if abs(fb.us - fa.us) <= bound else "changed"


def _err(f: Figure) -> str:
    return "unchecked" if f.rel_error is None else f"{100 * f.rel_error:.1f}%"


def rows(records_a: list[dict], records_b: list[dict]) -> list[list[str]]:
    """One row per matched point, figure and side (see the module docstring)."""
    out = []
    for ra, rb in _pairs(records_a, records_b):
        ta, tb = TraceRecord.from_info(ra["info"]), TraceRecord.from_info(rb["info"])
        figures = [("layer", layer_figure, lambda t, s: (t.headline.padding_tax or {}).get(s))]
        if ta.headline.ep_step is not None and tb.headline.ep_step is not None:
            figures.insert(0, ("EP step", ep_figure, lambda t, s: t.headline.ep_step.padding_tax))
        for what, figure, tax in figures:
            for side in SIDES:
                fa, fb = with_timing_noise(ta, figure(ta, side)), with_timing_noise(tb, figure(tb, side))
                out.append([tb.capture_list, what, side, cells.fixed(fa.us / 1e3, 2), _err(fa),
                            cells.fixed(fb.us / 1e3, 2), _err(fb),
                            cells.ratio(fb.us / fa.us) if fa.us else "n/a",
                            _tax(tax(ta, side), ra if what == "layer" else None),
                            _tax(tax(tb, side), rb if what == "layer" else None), _verdict(fa, fb)])
    return out


def _tax(v, pair_record: dict | None = None) -> str:
    """A tax, or `not comparable` where it rests on the masked/oblivious pair the run calls not comparable."""
    if pair_record is not None and noise.not_comparable(pair_record):
        return "not comparable"
    return "n/a" if v is None else f"{100 * v:.1f}%"


HEAD = ["capture list", "figure", "side", "A ms", "A error", "B ms", "B error", "B/A", "A tax", "B tax", "verdict"]


def lines(records_a: list[dict], records_b: list[dict]) -> list[str]:
    """The trace-answers table under compare's own (none where no serving_trace point matches)."""
    table = rows(records_a, records_b)
    if not table:
        return []
    return ["# the traces' answers (serving_trace): the EP step and the layer over the trace, each with its model's "
            "error; the tax is the EP step's (one figure) or each side's layer's"] + cells.columns(HEAD, table)
