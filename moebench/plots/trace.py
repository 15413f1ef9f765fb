"""Serving-trace figures, from the records' `info.trace_steps` and their typed record (moebench.bench.serving_trace
.record: TraceRecord): tokens per step (real vs the rows each producer added), the cumulative MoE-layer time masked
vs oblivious, the padding tax per capture list, and the EP step's bars and timeline."""

from __future__ import annotations

from pathlib import Path

from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.trace_record import TraceRecord
from moebench.plots.common import Run, figure_title, slug, split, value_of, varying
from moebench.plots.draw import Plot, new_figure, palette, save
from moebench.report.ranking import error_word  # the model's word, phrased as the report's tables phrase it

_PRODUCERS = ("cudagraph", "dp", "sp")  # moebench.inputs.engine_padding.PRODUCERS (rows added, in order)


def _trace_records(run: Run) -> list[dict]:
    return [r for r in run.ok if r.get("target") == "serving_trace"
            and isinstance((r.get("info") or {}).get("trace_steps"), list)
            and isinstance((r.get("info") or {}).get("headline"), dict)]


def _headline_records(run: Run) -> list[dict]:
    """The serving_trace records with a headline (a long trace keeps no per-step list: its tax is still drawn)."""
    return [r for r in run.ok if r.get("target") == "serving_trace"
            and isinstance((r.get("info") or {}).get("headline"), dict)]


def _record_group(recs: list[dict], r: dict) -> dict:
    """The parameters that tell record r from the others of its figure kind (one figure a record)."""
    return {k: value_of(r, k) for k in varying(recs, exclude=("capture_sizes",))}


def _typed(r: dict) -> TraceRecord:
    return TraceRecord.from_info(r["info"])


def _list_label(r: dict) -> str:
    return _typed(r).capture_list


def trace_tokens(run: Run, out: Path) -> list[Plot]:
    """One figure per record: real tokens per step (over the DP ranks) and the rows each producer added, stacked."""
    plots = []
    recs = _trace_records(run)
    for r in recs:
        steps = r["info"]["trace_steps"]
        if not steps:
            continue
        # step="post" draws each value up to the next x: one more x gives the last step its width
        xs = [s["step"] for s in steps] + [steps[-1]["step"] + 1]
        layers = [[sum(s["real"]) for s in steps]] + [[s["added_rows"][k] for s in steps] for k in _PRODUCERS]
        layers = [layer + layer[-1:] for layer in layers]
        fig, axes = new_figure(1, 1, panel_w=9.0, panel_h=3.4)
        ax = axes[0, 0]
        colors = ["#4c72b0"] + palette(len(_PRODUCERS), "autumn")
        ax.stackplot(xs, layers, labels=["real tokens"] + [f"padding: {k}" for k in _PRODUCERS], colors=colors,
                     step="post")
        ax.set_xlabel("trace step")
        ax.set_ylabel("rows over all layer calls")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, alpha=0.3)
        group = {"capture_sizes": _list_label(r), **_record_group(recs, r)}
        title = figure_title(run, "Tokens per step: real vs padded, per producer", [r], ("capture_sizes",), group)
        path = out / f"trace_tokens{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("trace_tokens", path, title, 1, group))
    return plots


def _cumulative(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total / 1e3)
    return out


def trace_cumulative(run: Run, out: Path) -> list[Plot]:
    """Cumulative layer time over the trace (ms), masked solid, oblivious dashed, one colour per capture list."""
    recs = _trace_records(run)
    plots = []
    for group, rs in split(recs, ("capture_sizes",)):
        fig, axes = new_figure(1, 1, panel_w=8.0, panel_h=3.8)
        ax = axes[0, 0]
        for r, c in zip(rs, palette(len(rs), "tab10")):
            steps = r["info"]["trace_steps"]
            xs = [s["step"] for s in steps]
            for side, ls in (("masked", "-"), ("oblivious", "--")):
                ax.plot(xs, _cumulative([s["layer_us"][side] for s in steps]), color=c, ls=ls,
                        label=f"{_list_label(r)} {side}")
        ax.set_xlabel("trace step")
        ax.set_ylabel("cumulative MoE-layer time (ms)")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, alpha=0.3)
        title = figure_title(run, "Cumulative layer time over the trace, masked vs oblivious", rs,
                             ("capture_sizes",), group)
        path = out / f"trace_cumulative{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("trace_cumulative", path, title, len(rs), group))
    return plots


def trace_tax(run: Run, out: Path) -> list[Plot]:
    """Padding tax (share of the layer time spent on padded rows) per capture list, oblivious vs masked; a list
    whose two sides are not comparable (report.noise) gets no bars, said on the plot; each bar's label carries the
    model's word on its layer time (timed, its held-out error, or unchecked)."""
    from moebench.report.noise import not_comparable

    recs = _headline_records(run)
    plots = []
    for group, rs in split(recs, ("capture_sizes",)):
        labels = [_list_label(r) for r in rs]
        fig, axes = new_figure(1, 1, panel_w=max(4.0, 1.2 * len(rs) + 2), panel_h=3.6)
        ax = axes[0, 0]
        width = 0.38
        shown = [not_comparable(r) is None for r in rs]
        for k, (side, c) in enumerate((("oblivious", "#c44e52"), ("masked", "#55a868"))):
            xs = [i + (k - 0.5) * width for i, ok in enumerate(shown) if ok]
            vals = [100 * (_typed(r).headline.padding_tax[side] or 0.0) for r, ok in zip(rs, shown) if ok]
            ax.bar(xs, vals, width, color=c, label=side)
        for i, ok in enumerate(shown):
            if not ok:
                ax.text(i, 0, "not comparable", ha="center", va="bottom", fontsize=7, rotation=90)
        words = [" | ".join(error_word(_typed(r).layer_error(s)[0]) for s in ("oblivious", "masked")) for r in rs]
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([f"{label}\n{word}" for label, word in zip(labels, words)], fontsize=7)
        ax.set_ylabel("padding tax (% of layer time)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        title = figure_title(run, "Padding tax per capture list", rs, ("capture_sizes",), group)
        path = out / f"trace_tax{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("trace_tax", path, title, len(rs), group))
    return plots


def _ep_records(run: Run) -> list[dict]:
    return [r for r in run.ok if r.get("target") == "serving_trace"
            and isinstance(((r.get("info") or {}).get("headline") or {}).get("ep_step"), dict)]


_EP_PARTS = (("mean rank's experts", "#4c72b0"), ("wait for the slowest rank", "#c44e52"),
             ("dispatch", "#8172b2"), ("combine", "#ccb974"))


def ep_step_bars(run: Run, out: Path) -> list[Plot]:
    """The EP step over the trace per EP size, masked vs oblivious: the mean rank's expert time, the wait for the
    slowest rank, dispatch and combine, stacked (seconds over the trace; with DBO the step is shorter than the
    stack by the overlap, marked with a tick)."""
    recs = _ep_records(run)
    plots = []
    for group, rs in split(recs, ("ep_size", "ranks_per_node")):
        rs = sorted(rs, key=lambda r: r["params"].get("ep_size", 0))
        fig, axes = new_figure(1, 1, panel_w=max(5.0, 1.6 * len(rs) + 2), panel_h=3.8)
        ax = axes[0, 0]
        xs, labels = [], []
        for i, r in enumerate(rs):
            ep = _typed(r).headline.ep_step
            for k, side in enumerate(SIDES):
                x = i + (k - 0.5) * 0.4
                parts = [ep.mean_rank_us[side], ep.straggler_wait_us[side], ep.dispatch_us[side],
                         ep.combine_us[side]]
                bottom = 0.0
                for (name, color), v in zip(_EP_PARTS, parts):
                    ax.bar(x, v / 1e6, 0.36, bottom=bottom, color=color, hatch="//" if side == "oblivious" else None,
                           edgecolor="white", label=name if (i, k) == (0, 0) else None)
                    bottom += v / 1e6
                ax.plot([x - 0.18, x + 0.18], [ep.step_us[side] / 1e6] * 2, color="black", lw=1.5)
                ax.text(x, max(bottom, ep.step_us[side] / 1e6), error_word(_typed(r).ep_step_error()[0]),
                        ha="center", va="bottom", fontsize=6)  # the rank model's word on this bar
                xs.append(x)
                labels.append(f"EP {r['params'].get('ep_size')}\n{side}")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("time over the trace (s)")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
        title = figure_title(run, "EP step: slowest rank's experts, its wait and the wire, masked vs oblivious (hatched)",
                             rs, ("ep_size", "ranks_per_node"), group)
        path = out / f"ep_step_bars{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("ep_step_bars", path, title, len(rs), group))
    return plots


TIMELINE_STEPS = 200  # the stretch of the trace a timeline shows


def _timeline_steps(run: Run, r: dict) -> list[dict]:
    """The first TIMELINE_STEPS steps' EP figures: from the record, or from the run's step file for a long trace."""
    info = r["info"]
    if info.get("trace_steps"):
        return info["trace_steps"][:TIMELINE_STEPS]
    if not info.get("step_file"):
        return []
    from moebench.traces.step_file import read_step_columns

    try:
        cols, _ = read_step_columns(run.path, info["step_file"])
    except (OSError, ValueError):
        return []  # a slimmed or moved run without its step file: no timeline
    n = min(TIMELINE_STEPS, len(cols["rows"]))
    names = ("ep_step_us", "ep_experts_us", "ep_mean_rank_us")
    if f"{names[0]}_masked" not in cols:
        return []
    return [{"step": i, **{k: {side: float(cols[f"{k}_{side}"][i]) for side in SIDES}
                           for k in names}} for i in range(n)]


def ep_timeline(run: Run, out: Path) -> list[Plot]:
    """Per step, for a stretch of the trace: the EP step time masked vs oblivious and its slowest rank's wait."""
    plots = []
    recs = _ep_records(run)
    for r in recs:
        steps = _timeline_steps(run, r)
        if not steps or "ep_step_us" not in steps[0]:
            continue
        xs = [s["step"] for s in steps]
        fig, axes = new_figure(2, 1, panel_w=9.0, panel_h=2.6, sharex=True)
        top, bottom = axes[0, 0], axes[1, 0]
        for side, c, ls in (("masked", "#55a868", "-"), ("oblivious", "#c44e52", "--")):
            top.plot(xs, [s["ep_step_us"][side] / 1e3 for s in steps], color=c, ls=ls, lw=1, label=side)
            bottom.plot(xs, [(s["ep_experts_us"][side] - s["ep_mean_rank_us"][side]) / 1e3 for s in steps],
                        color=c, ls=ls, lw=1, label=side)
        top.set_ylabel("EP step (ms)")
        bottom.set_ylabel("wait for the\nslowest rank (ms)")
        bottom.set_xlabel("trace step")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="upper right")
        group = {"capture_sizes": _list_label(r), **_record_group(recs, r)}
        title = figure_title(run, f"EP step per step, the first {len(steps)} steps", [r],
                             ("capture_sizes", "ep_size"), group)
        path = out / f"ep_timeline{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("ep_timeline", path, title, 1, group))
    return plots
