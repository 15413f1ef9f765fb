"""The headline of a serving_trace run, from its stored records. The EP step (where the run has EP ranks): the step
time masked and oblivious, the tax of padding and its split (GEMM work, the wait for the straggler, the wire), the
slowest rank's share of the padded routes and how the rank times and the wire were had. The single-rank view: per
engine configuration and capture list, this rank's MoE layer over the trace masked and oblivious, the padding tax,
what the masks recover (a figure inside the timings' noise says so instead of a share), the expert-GEMM rows
computed for padding, the slowest EP rank's excess routes and the predicted fixed-capacity compiles; and, where the
run sweeps capture lists, their ranking per configuration by the step time of the side deployed, each figure with
the error its model states (report.ranking).

Every figure is read from a record's info through its typed record (moebench.bench.serving_trace.record:
TraceRecord.from_info); nothing is re-run. In the tables, every figure the rank model or the shape model made
carries that model's word as the ranking and the plots phrase it (report.ranking.error_word: its held-out error,
or unchecked); a figure read off timings carries none, nor does the wire's (the wire model's). A layer pair the run
calls not comparable is flagged on its layer cells as on its tax. The footer also says what each phase of a point
cost and, where the rank times and the wire figures come from different cards, a note saying so.
The runner prints `footer_lines` under its table and `moebench report` shows `table` before anything else.
"""

from __future__ import annotations

from typing import Any

from moebench.bench.serving_trace.record import SIDES, TraceHeadline
from moebench.bench.serving_trace.trace_record import TraceRecord
from moebench.report import cells, noise, ranking
from moebench.report.headline import format_value
from moebench.report.ranking import error_word

TARGET = "serving_trace"
# the figures a serving_trace report shows beside its tables, before everything else (moebench.plots.trace)
LEAD_PLOTS = ("ep_step_bars", "ep_timeline")


def trace_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("target") == TARGET and r.get("status") == "ok"
            and isinstance((r.get("info") or {}).get("headline"), dict)]


def typed(r: dict) -> TraceRecord:
    """A serving_trace record's info, typed (moebench.bench.serving_trace.record)."""
    return TraceRecord.from_info(r["info"])


def _pct(v: Any) -> str:
    return "n/a" if v is None else f"{round(100 * v, 1) + 0.0:.1f}%"  # + 0.0: no "-0.0%"


def _ms(v: Any) -> str:
    """Microseconds as milliseconds, fixed-point (report.cells: one format everywhere, never scientific)."""
    return "n/a" if v is None else cells.fixed(round(v / 1e3, 2) + 0.0, 2)  # + 0.0: no "-0.00"


def _not_comparable(h: TraceHeadline) -> str | None:
    """Why this record's two sides are not comparable (report.noise.not_comparable), or None."""
    return noise.not_comparable({"info": {"headline": h.to_info()}})


def _model_word(rel_error: float | None) -> str:
    """The model's word on a table cell's figure (report.ranking.error_word); nothing where it was timed."""
    return "" if rel_error == 0 else error_word(rel_error)


def _ep_word(t: TraceRecord) -> str:
    """The rank model's word on the EP step's figures (TraceRecord.ep_step_error, as the ranking reads it)."""
    if t.ep_step is None:  # a headline without its EP record: no held-out error to state
        return "" if t.headline.ep_step.rank_times == "timed" else "unchecked"
    return _model_word(t.ep_step_error()[0])


def _layer_words(t: TraceRecord) -> dict[str, str]:
    """Per side, the shape model's (or the interpolation's) word on the layer's figures (TraceRecord.layer_error)."""
    return {side: _model_word(t.layer_error(side)[0]) for side in SIDES}


def _pair_word(t: TraceRecord) -> str:
    """The word on a figure resting on both sides' layer times: theirs where the two agree, else each side's."""
    errors = {side: t.layer_error(side)[0] for side in SIDES}
    if errors["oblivious"] == errors["masked"]:
        return _model_word(errors["masked"])
    return " / ".join(f"{side} {error_word(errors[side])}" for side in ("oblivious", "masked"))


def _with_word(text: str, word: str) -> str:
    """A time with the model's word after it (`1302.40 ±1.8%`), bare where it was timed or is missing."""
    return f"{text} {word}" if word and text != "n/a" else text


def _with_model(text: str, word: str) -> str:
    """A share or a saving computed from modelled times: the word is on those times, not an error of the share."""
    return f"{text} (model {word})" if word and text != "n/a" else text


def _tax(h: TraceHeadline, side: str, word: str = "") -> str:
    """The padding tax, `no padded row` where none was padded, `not comparable` where the masked side is slower on
    the real rows alone, or `within noise` when the padding time is inside the timings' spread; `word`: the
    model's word on the times it was computed from (the tables'; the footer states the models apart)."""
    if h.padded_rows == 0:
        return "no padded row"
    if _not_comparable(h):
        return "not comparable"
    if h.within_noise("padding_tax", side):
        return "within noise"
    return _with_model(_pct(h.padding_tax[side]), word)


def _recovered(h: TraceHeadline, word: str = "") -> str:
    """What the masks recover, as a share of the oblivious padding time only where both are outside the noise;
    nothing where no row was padded or the two sides are not comparable (a difference that would read as a
    saving or a loss of the masks is the sides' speeds on the real rows); `word` as for _tax."""
    if h.padded_rows == 0:
        return "nothing (no padded row)"
    why = _not_comparable(h)
    if why:
        return why.replace("not comparable: ", "not comparable (") + ")"
    if h.within_noise("recovered"):
        return "within noise"
    if h.within_noise("padding_tax", "oblivious"):
        return _with_model(f"{_ms(h.recovered_us)} ms (the padding time is within noise: no share)", word)
    return _with_model(f"{_ms(h.recovered_us)} ms ({_pct(h.recovered_share)} of the padding time)", word)


def _layer_cell(t: TraceRecord, side: str) -> str:
    """One side's layer over the trace with its model's word, flagged where the run calls the two sides not
    comparable (as its headline does)."""
    cell = _with_word(_ms(t.headline.layer_us[side]), _layer_words(t)[side])
    return f"{cell} (not comparable)" if _not_comparable(t.headline) else cell


def _spread(percentiles: dict) -> str:
    """Both sides' p50 / p99 / max of a step's time, in ms."""
    return " | ".join(" / ".join(_ms(percentiles[side][k]) for k in ("p50", "p99", "max"))
                      for side in ("oblivious", "masked")) + " ms"


def _timed(t: TraceRecord) -> str:
    """Shapes timed, and how (records from before trace_real_points timed every distinct shape)."""
    n = t.trace_real_points or 0
    timed = t.timed_shapes if t.timed_shapes is not None else t.distinct_shapes
    return f"{timed}, interpolated N={n}" if n else f"{timed}"


def _overlap(t: TraceRecord, split: dict) -> str | None:
    """The DBO overlap of the tax split in ms, or None without DBO: there nothing overlaps, and the split's
    overlap_us is only the float residue of the step minus its parts (a "0.00 ms" that would read as measured)."""
    return _ms(split["overlap_us"]) if (t.engine or {}).get("dbo") else None


def config_label(r: dict) -> str:
    t = typed(r)
    e = t.engine or {}
    trace = (t.trace or {}).get("source")
    return (f"DP {e.get('dp_size')}, SP {e.get('sp_size')}, DBO {'on' if e.get('dbo') else 'off'}, EP {e.get('ep_size')}"
            + (f", trace {trace}" if trace else ""))


def _rank_words(records: list[dict]) -> dict[tuple[str, str], str]:
    """{(configuration key, capture list): its word in the masked ranking} (report.ranking)."""
    out = {}
    for rk in ranking.rankings(trace_records(records), config_label):
        if rk.side != "masked":
            continue
        for f in rk.figures:
            out[(rk.key, f.capture_list)] = f"not ranked: {rk.refused}" if rk.refused else ""
        for f, word in rk.verdicts():
            out[(rk.key, f.capture_list)] = word
    return out


HEAD = ["capture list", "engine", "distinct shapes / timed / steps", "layer ms oblivious", "layer ms masked",
        "padding tax oblivious", "padding tax masked", "masks recover", "padded rows", "GEMM rows for padding",
        "EP excess from padding (routes)", "compiles oblivious / masked", "masked step vs the fastest list"]


def table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per serving_trace record (HEAD names the columns)."""
    words = _rank_words(records)
    rows = []
    for r in trace_records(records):
        t = typed(r)
        h = t.headline
        compiles = h.jit_compiles or {}
        side_words = _layer_words(t)
        rows.append([t.capture_list, config_label(r), f"{t.distinct_shapes} / {_timed(t)} / {t.steps}",
                     _layer_cell(t, "oblivious"), _layer_cell(t, "masked"),
                     _tax(h, "oblivious", side_words["oblivious"]), _tax(h, "masked", side_words["masked"]),
                     _recovered(h, _pair_word(t)),
                     f"{h.padded_rows} ({_pct(h.padding_row_share)})",
                     f"{h.padding_gemm_rows['oblivious']} / {h.padding_gemm_rows['masked']}",
                     format_value(h.ep_excess_from_padding),
                     f"{format_value(compiles.get('oblivious'))} / {format_value(compiles.get('masked'))}",
                     words.get((ranking.config_key(r), t.capture_list), "")])
    return HEAD, rows


EP_HEAD = ["capture list", "engine", "trace", "step ms oblivious", "step ms masked", "EP tax",
           "slowest rank: expert ms obl / masked", "straggler wait ms obl / masked", "wire ms obl / masked",
           "tax split ms: GEMM / straggler / wire / DBO overlap", "slowest rank's share of padded routes",
           "rank times", "replay (experts, step) within tolerance"]


def _replay_cell(t: TraceRecord) -> str:
    ep = t.ep_step
    if ep is None or ep.replay is None:
        return "not run"
    return f"{ep.replay_label()} (tolerance {_pct(ep.replay.tolerance)})"


def _sides(us: dict[str, float], word: str) -> str:
    """Both sides' times, oblivious first, each with the model's word."""
    return " / ".join(_with_word(_ms(us[side]), word) for side in ("oblivious", "masked"))


def ep_table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): the EP step of every serving_trace record that has one: step time per side, the tax and its
    split, the straggler's wait, the wire, how the rank times were had and the replay check."""
    rows = []
    for r in trace_records(records):
        t = typed(r)
        ep = t.headline.ep_step
        if ep is None:
            continue
        split, word = ep.tax_split_us, _ep_word(t)
        wire = t.ep_step.wire_label() if t.ep_step is not None else "?"
        overlap = _overlap(t, split)
        # the rank model's word on every figure the rank times make; the wire's figures rest on the wire model
        rows.append([t.capture_list, config_label(r), f"{(t.trace or {}).get('source')}, {t.steps} steps",
                     _with_word(_ms(ep.step_us["oblivious"]), word), _with_word(_ms(ep.step_us["masked"]), word),
                     _with_model(_pct(ep.padding_tax), word), _sides(ep.experts_us, word),
                     _sides(ep.straggler_wait_us, word), _sides(ep.wire_us, ""),
                     " / ".join([_with_word(_ms(split["gemm_us"]), word), _with_word(_ms(split["straggler_us"]), word),
                                 _ms(split["wire_us"]), _with_word(overlap, word) if overlap else "DBO off"]),
                     _pct(ep.slowest_rank_padded_route_share),
                     f"{t.ep_step.rank_times_label() if t.ep_step else ep.rank_times}; wire {wire}", _replay_cell(t)])
    return EP_HEAD, rows


def sections(records: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's serving-trace tables, in order: the EP step (when the run has one), then the single-rank view."""
    out = []
    head, rows = ep_table(records)
    if rows:
        out.append(("EP step: the padding tax of the slowest rank and the wire", head, rows))
    head, rows = table(records)
    if rows:
        out.append(("Padding tax over the trace, single-rank view" if out else "Padding tax over the trace",
                    head, rows))
    return out


def footer_lines(records: list[dict]) -> list[str]:
    """The padding-tax lines the runner prints under its table (none for other targets)."""
    recs = trace_records(records)
    if not recs:
        return []
    out = ["padding tax over the trace (oblivious | masked):"]
    for r in recs:
        t = typed(r)
        h = t.headline
        out.append(f"  {t.capture_list} ({config_label(r)}): single-rank layer "
                   f"{_ms(h.layer_us['oblivious'])} | {_ms(h.layer_us['masked'])} ms, tax {_tax(h, 'oblivious')}"
                   f" | {_tax(h, 'masked')}, masks recover {_recovered(h)}, {t.distinct_shapes} distinct "
                   f"shapes ({_timed(t)} timed) over {t.steps} steps")
        if h.step_percentiles_us:
            out.append(f"    a step's layer (oblivious | masked), p50 / p99 / max: {_spread(h.step_percentiles_us)}")
        ep = h.ep_step
        if ep is not None and t.ep_step is not None:
            split = ep.tax_split_us
            out.append(f"    EP step: {_ms(ep.step_us['oblivious'])} | {_ms(ep.step_us['masked'])} ms, tax "
                       f"{_pct(ep.padding_tax)}: GEMM on padding {_ms(split['gemm_us'])} ms, straggler wait "
                       f"{_ms(split['straggler_us'])} ms, wire {_ms(split['wire_us'])} ms"
                       + (f", DBO overlap {_overlap(t, split)} ms" if _overlap(t, split) else "")
                       + f"; replay {_replay_cell(t)}")
            if ep.step_percentiles_us:
                out.append(f"    a step's EP step (oblivious | masked), p50 / p99 / max: "
                           f"{_spread(ep.step_percentiles_us)}")
            out.append(f"    rank times: {t.ep_step.rank_times_label()}")
            out.append(f"    wire {t.ep_step.wire_label()}")
            if t.ep_step.card_note:
                out.append(f"    note: {t.ep_step.card_note}")
        if t.shapes_label():
            out.append(f"    {t.shapes_label()}")
        if t.phase_wall_s:
            out.append(f"    phases: {t.phases_label()}")
    if any(typed(r).headline.within_noise("recovered") is None for r in recs):
        out.append("  (a figure's noise is unknown where shapes were timed with fewer than 5 samples or interpolated)")
    out += [f"  {rk.line()}" for rk in ranking.rankings(recs, config_label)]
    if any(r.get("triton_interpret") for r in recs):
        out.append("  (timed under Triton's CPU interpreter: the times and taxes are a smoke signal, not GPU figures)")
    return out
