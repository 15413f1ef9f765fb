"""Each impl's p50 over the best other peer's p50 at the same point (moebench.report.peers), vs num_tokens: one panel
per kernel family, one line per impl; below the line at 1 an impl is faster than every peer there."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, param, split
from moebench.plots.draw import Plot, log2_ticks, palette, panel_figure, save_panels
from moebench.report.peers import peer_ratios, point_of


def peer_ratio(run: Run, out: Path) -> list[Plot]:
    # a ratio between timing modes (interpreted Triton vs torch on a CPU) is no figure to draw
    rows = {(r["impl"], point_of(r)): r for r in peer_ratios(run.records) if r["comparable"]}
    recs = [{**r, "peer_ratio": rows[(r["impl"], point_of(r))]["ratio"]} for r in run.ok
            if (r.get("impl"), point_of(r)) in rows and param(r, "num_tokens") is not None]
    if not recs:
        return []
    dims = ("num_tokens", "impl", "seed", "repeat")
    plots = []
    for group, rs in split(recs, dims):
        kernels = list(dict.fromkeys(r.get("kernel") or r["impl"].split(".")[0] for r in rs))
        fig, axes = panel_figure(len(kernels))
        for ax, kernel in zip(axes.flat, kernels):
            sub = [r for r in rs if (r.get("kernel") or r["impl"].split(".")[0]) == kernel]
            impls = list(dict.fromkeys(r["impl"] for r in sub))
            for impl, color in zip(impls, palette(len(impls), "tab10")):
                pts = sorted((param(r, "num_tokens"), r["peer_ratio"]) for r in sub if r["impl"] == impl)
                peer = any(r.get("library") for r in sub if r["impl"] == impl)
                ax.plot([x for x, _ in pts], [y for _, y in pts], "--" if peer else "-", marker="o", ms=3,
                        color=color, label=impl)
            ax.axhline(1.0, color="black", lw=0.8, alpha=0.5)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            log2_ticks(ax, [param(r, "num_tokens") for r in sub])
            ax.set_title(kernel, fontsize=9)
            ax.set_xlabel("num_tokens (rows per rank)")
            ax.set_ylabel("p50 / best other peer's p50")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        plots.append(save_panels(fig, axes, len(kernels), run, out, "peer_ratio",
                                 "Ratio to the best peer at the same point (dashed: peers)", rs, dims, group))
    return plots
