"""Layer p50 per stage (stacked bars) vs padding ratio, masked vs unmasked, with the whole layer timed as one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moebench.plots.common import Run, fmt_value, median, param, sorted_unique, split, stat
from moebench.plots.draw import Plot, palette, panel_figure, save_panels
from moebench.plots.pairing import mask_of, mode_of


def stage_p50(stats: Any) -> float | None:
    if isinstance(stats, dict):
        v = stats.get("p50")
    else:
        v = stats
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def layer_stages(run: Run, out: Path) -> list[Plot]:
    recs = [r for r in run.ok if isinstance(r.get("stages"), dict) and r["stages"]]
    if not recs:
        return []
    dims = ("padding_ratio", "mask", "impl")
    plots = []
    for group, rs in split(recs, dims):
        stages: list[str] = []
        for r in rs:
            for s in r["stages"]:
                if s not in stages:
                    stages.append(s)
        stage_colors = dict(zip(stages, palette(len(stages), "tab10")))
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        ratios = sorted_unique(param(r, "padding_ratio") for r in rs) or [None]
        masks = [m for m in (True, False, None) if any(mask_of(r) is m for r in rs)]
        modes = {mode_of(r) for r in rs}
        unmasked_word = " / ".join(w for m, w in (("unmasked", "unmasked"), ("oblivious", "mask-oblivious"))
                                   if m in modes)
        # bar slots per panel: an oblivious twin's panel has only unmasked bars, not an empty masked slot
        panel_masks = {impl: [m for m in masks if any(r["impl"] == impl and mask_of(r) is m for r in rs)]
                       for impl in impls}
        slots = max(len(m) for m in panel_masks.values())
        fig, axes = panel_figure(len(impls), 2, panel_w=max(5.0, 1.2 * len(ratios) * slots), sharey=True)
        for ax, impl in zip(axes.flat, impls):
            width = 0.8 / len(panel_masks[impl])
            for xi, ratio in enumerate(ratios):
                for mi, mask in enumerate(panel_masks[impl]):
                    sub = [r for r in rs if r["impl"] == impl and param(r, "padding_ratio") == ratio
                           and mask_of(r) is mask]
                    if not sub:
                        continue
                    x = xi - 0.4 + width * (mi + 0.5)
                    bottom = 0.0
                    for s in stages:
                        v = median([stage_p50(r["stages"].get(s)) for r in sub])
                        if not v:
                            continue
                        ax.bar(x, v, width=width * 0.95, bottom=bottom, color=stage_colors[s],
                               hatch="//" if mask is False else None, edgecolor="white", lw=0.5)
                        bottom += v
                    whole = median([stat(r) for r in sub])
                    if whole:
                        ax.plot([x - width * 0.45, x + width * 0.45], [whole, whole], color="black", lw=1.5)
            ax.set_xticks(range(len(ratios)))
            ax.set_xticklabels([fmt_value(r) for r in ratios])
            ax.set_xlabel("padding ratio" + (f"  (plain = masked, hatched = {unmasked_word})" if False in masks
                                             else ""))
            ax.set_title(impl, fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("p50 per stage (us), stacked")
        from matplotlib.patches import Patch

        handles = [Patch(color=stage_colors[s], label=s) for s in stages]
        if False in masks:
            handles.append(Patch(facecolor="lightgrey", hatch="//", label=unmasked_word))
        if any(stat(r) for r in rs):
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], color="black", lw=1.5, label="whole layer p50"))
        axes.flat[0].legend(handles=handles, fontsize=7)
        plots.append(save_panels(fig, axes, len(impls), run, out, "layer_stages", "Layer latency per stage",
                                 rs, dims, group))
    return plots
