"""Achieved fraction of the roofline (roofline_us / p50) per impl vs num_tokens."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, aggregate, fmt_value, param, sorted_unique, split
from moebench.plots.draw import Plot, log2_ticks, palette, panel_figure, save_panels
from moebench.plots.pairing import MODE_ORDER, mode_of, mode_styles, series_label


def roof_fraction(run: Run, out: Path) -> list[Plot]:
    recs = [r for r in run.ok if isinstance(r.get("roof_fraction"), (int, float)) and r["roof_fraction"] > 0
            and param(r, "num_tokens") is not None]
    if not recs:
        return []
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in split(recs, dims):
        ratios = sorted_unique(param(r, "padding_ratio") for r in rs) or [None]
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        colors = dict(zip(impls, palette(len(impls), "tab10")))
        styles = mode_styles(rs)
        fig, axes = panel_figure(len(ratios), sharey=True)
        for ax, ratio in zip(axes.flat, ratios):
            sub = [r for r in rs if param(r, "padding_ratio") == ratio]
            agg = aggregate(sub, lambda r: (r["impl"], mode_of(r), param(r, "num_tokens")))
            for impl in impls:
                for mode in MODE_ORDER:
                    pts = sorted((k[2], v["roof_fraction"]) for k, v in agg.items()
                                 if k[0] == impl and k[1] == mode and v["roof_fraction"])
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], styles[mode], marker="o", ms=3,
                                color=colors[impl], label=series_label(impl, mode))
            ax.axhline(1.0, color="black", lw=0.8, alpha=0.5)
            ax.set_xscale("log", base=2)
            log2_ticks(ax, [param(r, "num_tokens") for r in rs])
            ax.set_ylim(bottom=0)
            ax.set_title(f"padding ratio {fmt_value(ratio)}" if ratio is not None else "", fontsize=9)
            ax.set_xlabel("num_tokens (rows per rank)")
            ax.grid(True, alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("fraction of roofline (roofline_us / p50)")
        axes.flat[0].legend(fontsize=7)
        plots.append(save_panels(fig, axes, len(ratios), run, out, "roof_fraction", "Achieved fraction of the roofline",
                                 rs, dims, group))
    return plots
