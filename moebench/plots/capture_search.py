"""The capture search's Pareto curves: the trace's time against the number of graphs, one curve per side (the
best list of at most K sizes), the named capture lists as points (their graphs, their time). Drawn from a record's
`info.capture_search` alone (matplotlib, Agg); the command line draws one per capture-search point of a run
(`plot_records`), for `moebench capture-search` and `moebench run` alike."""

from __future__ import annotations

from pathlib import Path

SIDE_COLORS = {"masked": "#4c72b0", "oblivious": "#c44e52"}


def capture_search_plot(info: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = info["capture_search"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for side, color in SIDE_COLORS.items():
        curve = cs["sides"][side]["curve_us"]
        ax.plot(range(1, len(curve) + 1), [v / 1e3 for v in curve], color=color, label=f"{side}: best list")
        ax.axhline(cs["sides"][side]["lower_bound_us"] / 1e3, color=color, lw=0.6, ls=":")
        for name, figs in cs["named"].items():
            ax.scatter([figs["graphs"]], [figs[side]["time_us"] / 1e3], color=color, marker="o", s=18, zorder=3)
            ax.annotate(name, (figs["graphs"], figs[side]["time_us"] / 1e3), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("CUDA graphs captured (K)")
    ax.set_ylabel("MoE-layer time over the trace (ms)")
    card = cs.get("card", "")
    ax.set_title(f"capture search: time vs graphs ({card}); dotted: every size captured", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_records(records: list[dict], out_dir: Path) -> list[Path]:
    """Each capture-search record's figure in out_dir: `capture_search.png`, or `capture_search__point<N>.png` for
    each of several points."""
    several = len(records) > 1
    return [capture_search_plot(r["info"], out_dir / (f"capture_search__point{r.get('point')}.png" if several
                                                     else "capture_search.png")) for r in records]
