"""Latency vs tokens per rank: one panel per impl (a mask-aware impl shares its panel with its declared
mask-oblivious twin), one line per padding ratio and mode."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, aggregate, fmt_value, param, sorted_unique, split, stat
from moebench.plots.draw import Plot, log2_ticks, palette, panel_figure, save_panels
from moebench.plots.pairing import MODE_ORDER, mode_of, mode_styles, panel_names


def latency_vs_tokens(run: Run, out: Path) -> list[Plot]:
    recs = [r for r in run.ok if stat(r) is not None and param(r, "num_tokens") is not None]
    if len({param(r, "num_tokens") for r in recs}) < 2:
        return []
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in split(recs, dims):
        if len({param(r, "num_tokens") for r in rs}) < 2:
            continue
        panel_of = panel_names(rs)  # a mask-aware impl and its oblivious twin share a panel
        panels = list(dict.fromkeys(panel_of[r["impl"]] for r in rs))
        styles = mode_styles(rs)
        ratios = sorted_unique(param(r, "padding_ratio") for r in rs) or [None]
        colors = dict(zip(ratios, palette(len(ratios))))
        fig, axes = panel_figure(len(panels), sharey=True)
        for ax, panel in zip(axes.flat, panels):
            agg = aggregate([r for r in rs if panel_of[r["impl"]] == panel],
                            lambda r: (param(r, "padding_ratio"), mode_of(r), param(r, "num_tokens")))
            for ratio in ratios:
                for mode in MODE_ORDER:
                    pts = sorted((k[2], v) for k, v in agg.items() if k[0] == ratio and k[1] == mode)
                    if not pts:
                        continue
                    xs = [x for x, _ in pts]
                    label = f"pad {fmt_value(ratio)}" + (f", {mode}" if mode is not None else "")
                    ax.plot(xs, [v["p50"] for _, v in pts], styles[mode], marker="o", ms=3,
                            color=colors[ratio], label=label)
                    band = [(x, v["p10"], v["p90"]) for x, v in pts if v["p10"] and v["p90"]]
                    if len(band) >= 2:
                        ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                                        color=colors[ratio], alpha=0.12, linewidth=0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            log2_ticks(ax, [param(r, "num_tokens") for r in rs])
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("num_tokens (rows per rank)")
            ax.grid(True, which="both", alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("latency p50 (us), band p10-p90")
        axes.flat[0].legend(fontsize=7, loc="upper left")
        plots.append(save_panels(fig, axes, len(panels), run, out, "latency_vs_tokens", "Latency vs tokens",
                                 rs, dims, group))
    return plots
