"""p50 vs EP size, simulated (computed) EP sizes drawn hollow."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, aggregate, fmt_value, param, sorted_unique, split, stat
from moebench.plots.draw import Plot, log2_ticks, palette, panel_figure, save_panels
from moebench.plots.pairing import MODE_ORDER, mode_of, mode_styles, series_label


def ep_scaling(run: Run, out: Path) -> list[Plot]:
    recs = [r for r in run.ok if stat(r) is not None and isinstance(param(r, "ep_size"), int)]
    if len({param(r, "ep_size") for r in recs}) < 2:
        return []
    # ep_mode only says whether a size is simulated: drawn as hollow markers, not split into figures.
    dims = ("ep_size", "padding_ratio", "mask", "impl", "ep_mode", "num_local_experts")
    plots = []
    for group, rs in split(recs, dims):
        if len({param(r, "ep_size") for r in rs}) < 2:
            continue
        ratios = sorted_unique(param(r, "padding_ratio") for r in rs) or [None]
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        colors = dict(zip(impls, palette(len(impls), "tab10")))
        styles = mode_styles(rs)
        fig, axes = panel_figure(len(ratios), sharey=True)
        any_sim = False
        for ax, ratio in zip(axes.flat, ratios):
            sub = [r for r in rs if param(r, "padding_ratio") == ratio]
            agg = aggregate(sub, lambda r: (r["impl"], mode_of(r), param(r, "ep_size")))
            for impl in impls:
                for mode in MODE_ORDER:
                    pts = sorted((k[2], v) for k, v in agg.items() if k[0] == impl and k[1] == mode)
                    if not pts:
                        continue
                    c = colors[impl]
                    ax.plot([x for x, _ in pts], [v["p50"] for _, v in pts], styles[mode], color=c,
                            label=series_label(impl, mode))
                    for x, v in pts:
                        ax.plot([x], [v["p50"]], "o", ms=6, color=c,
                                markerfacecolor="none" if v["simulated"] else c)
                        if v["simulated"]:
                            any_sim = True
                            ax.annotate("simulated", (x, v["p50"]), textcoords="offset points", xytext=(4, 4),
                                        fontsize=6, color=c)
            ax.set_xscale("log", base=2)
            log2_ticks(ax, [param(r, "ep_size") for r in rs])
            ys = [stat(r) for r in rs]
            if max(ys) > 10 * min(ys):  # log only when the latencies span a decade; else plain numbers read better
                ax.set_yscale("log")
            ax.set_title(f"padding ratio {fmt_value(ratio)}" if ratio is not None else "", fontsize=9)
            ax.set_xlabel("EP size (ranks)")
            ax.grid(True, which="both", alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("latency p50 (us)")
        ax0 = axes.flat[0]
        handles, labels = ax0.get_legend_handles_labels()
        if any_sim:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], marker="o", ls="", color="grey", markerfacecolor="none"))
            labels.append("simulated (computed, not measured)")
        ax0.legend(handles, labels, fontsize=7)
        plots.append(save_panels(fig, axes, len(ratios), run, out, "ep_scaling", "EP-size scaling",
                                 rs, dims, group))
    return plots
