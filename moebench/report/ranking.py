"""Which capture list is fastest for what is deployed: the capture lists a serving_trace run was given, ranked per
engine configuration by the step time of the side the engine runs, never by a share.

The figure ranked is the EP step over the trace where the run has EP ranks (the slowest rank plus the wire), else
this rank's MoE layer over the trace; per side (masked: an engine that masks its padded rows; oblivious: one that
does not), both shown, the masked side first. Each figure carries the error the models that made it state (the typed record's ep_step_error / layer_error):
  EP step     every rank workload timed: its timings (0 model error); a rank cost model: its held-out RMS error
              (the decisive workloads predicted before they were timed); a model whose every timing went to the
              design has no held-out error: unchecked;
  layer       every shape timed: its timings; the shape model: its held-out RMS error per side; interpolated:
              the replay's relative difference where it ran, else unchecked.
A list is `within noise` of the fastest when their difference is within the two figures' errors added (each error
x its figure; the errors of one run's model are not independent, so they add). The ranking refuses, saying why,
where a figure it would rank is unchecked. It ranks one side's lists against each other: whether the masked side
is comparable with the oblivious one (report.noise.not_comparable) is the tax's concern, not the ranking's. The
masked EP step does the same work under every list (without SP or DBO): where the lists' figures differ beyond
their stated errors the masked side is not ranked (`masked_disagreement`), as its differences are noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moebench.bench.serving_trace.knobs import config_keys
from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.trace_record import TraceRecord

RANKED_SIDES = SIDES  # the masked side first: what an engine that masks runs


@dataclass(frozen=True)
class Figure:
    """One capture list's ranked figure on one side: microseconds over the trace, its relative error (None:
    unchecked) and where the error comes from."""

    capture_list: str
    us: float
    rel_error: Optional[float]
    error_source: str


@dataclass(frozen=True)
class Ranking:
    """One configuration's ranking on one side: what is ranked, the figures fastest first (None with `refused`
    saying why), and per list beside the fastest: `within noise` or how much slower."""

    key: str  # config_key of its records
    config: str
    side: str
    what: str
    figures: list[Figure]
    refused: Optional[str] = None

    def verdicts(self) -> list[tuple[Figure, str]]:
        """(figure, its word): the fastest's error, the others' distance to it or `within noise`."""
        if self.refused or not self.figures:
            return []
        best = self.figures[0]
        out = [(best, f"fastest ({_error(best)})")]
        for f in self.figures[1:]:
            bound = best.rel_error * best.us + f.rel_error * f.us
            diff = f.us - best.us
            word = "within noise" if diff <= bound else f"+{100 * diff / best.us:.1f}%"
            out.append((f, f"{word} ({_error(f)})"))
        return out

    def line(self) -> str:
        head = f"fastest {self.side} {self.what} ({self.config}): "
        if self.refused:
            return head + f"not ranked: {self.refused}"
        return head + "; ".join(f"{f.capture_list} {f.us / 1e3:.2f} ms {word}" for f, word in self.verdicts())


def error_word(rel_error: Optional[float]) -> str:
    """A figure's model word, the one phrase the ranking, the report's tables and the plots give it: its error
    (`±1.8%`), `timed` (0: every workload or shape timed) or `unchecked` (None: no held-out error measured)."""
    if rel_error is None:
        return "unchecked"
    return "timed" if rel_error == 0 else f"±{100 * rel_error:.1f}%"


def _error(f: Figure) -> str:
    return f"{error_word(f.rel_error)} {f.error_source}" if f.rel_error else f.error_source


def ep_figure(t: TraceRecord, side: str) -> Figure:
    """The EP step over the trace on one side, with its model's word (TraceRecord.ep_step_error)."""
    return Figure(t.capture_list, t.headline.ep_step.step_us[side], *t.ep_step_error(side))


def layer_figure(t: TraceRecord, side: str) -> Figure:
    """The layer over the trace on one side, with its model's word (TraceRecord.layer_error)."""
    return Figure(t.capture_list, t.headline.layer_us[side], *t.layer_error(side))


def with_timing_noise(t: TraceRecord, f: Figure) -> Figure:
    """A layer figure read off timings (model error 0) carries the timings' own noise instead: the headline's bound
    on the layer over the trace (half the shapes' p10-p90 spreads, in quadrature over the calls); None (not known:
    fewer than 5 samples a shape, the interpreter's) leaves it unjudged."""
    if f.rel_error != 0:
        return f
    bound = ((t.headline.noise or {}).get("recovered_us"))
    if bound is None or not f.us:
        return Figure(f.capture_list, f.us, None, "timed, its noise unknown (fewer than 5 samples a shape)")
    return Figure(f.capture_list, f.us, bound / f.us, "the timings' spread")


def config_key(r: dict) -> str:
    """The engine configuration a what-if over capture lists holds fixed (knobs.config_keys)."""
    params = r.get("params") or {}
    return repr([(k, params[k]) for k in config_keys(params)])


def rankings(records: list[dict], label_of) -> list[Ranking]:
    """Per configuration with two or more capture lists, per side: the ranking of its lists. `label_of(record)`:
    the configuration's words."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(config_key(r), []).append(r)
    out = []
    for key, recs in groups.items():
        if len({TraceRecord.from_info(r["info"]).capture_list for r in recs}) < 2:
            continue
        typed = [TraceRecord.from_info(r["info"]) for r in recs]
        ep = all(t.ep_step is not None and t.headline.ep_step is not None for t in typed)
        for side in RANKED_SIDES:
            figures = [ep_figure(t, side) if ep else with_timing_noise(t, layer_figure(t, side)) for t in typed]
            refused = next((f"{f.capture_list}: {f.error_source}" for f in figures if f.rel_error is None), None)
            if refused is None and side == "masked" and ep and _masked_work_fixed(typed[0]):
                refused = masked_disagreement(figures)
            out.append(Ranking(key, label_of(recs[0]), side, "EP step" if ep else "single-rank layer",
                               sorted(figures, key=lambda f: (f.us, f.capture_list)), refused))
    return out


def _masked_work_fixed(t: TraceRecord) -> bool:
    """Whether the masked EP step does the same work under every capture list: its padded rows route nowhere, and
    without SP chunks or DBO halves (both cut at the padded size) the real rows' split does not move either."""
    return int(t.engine.get("sp_size", 1)) == 1 and not t.engine.get("dbo", False)


def masked_disagreement(figures: list[Figure]) -> str | None:
    """Why the lists' masked EP steps cannot be ranked, or None: they do the same work, so they must agree within
    the errors the run states (each error x its figure, added, as `within noise` reads them); past that the
    difference is the rank timings' noise, not the lists'."""
    low, high = min(figures, key=lambda f: f.us), max(figures, key=lambda f: f.us)
    if high.us - low.us <= low.rel_error * low.us + high.rel_error * high.us:
        return None
    return (f"the masked EP step does the same work under every list, yet {high.capture_list}'s is "
            f"{100 * (high.us - low.us) / low.us:.1f}% above {low.capture_list}'s, beyond the errors stated "
            f"({error_word(low.rel_error)}, {error_word(high.rel_error)}): the rank times did not settle")


