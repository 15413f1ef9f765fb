"""The capture search's Pareto curves: the trace's time against the number of graphs, one curve per side (the
best list of at most K sizes), the named capture lists as points (their graphs, their time); the layer's panel, and
the EP step's beside it where the point has EP ranks. Drawn from a record's
`info.capture_search` alone (matplotlib, Agg): one per capture-search point of a run (`plot_records`), drawn as one
of the run's figures (`capture_search_figures`, in moebench.plots.FIGURES), so `moebench capture-search`, `moebench
run`, `moebench plot` and `moebench report` draw it alike."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run
from moebench.plots.draw import Plot, new_figure
from moebench.records import unique_records
from moebench.report.capture_search import search_records

SIDE_COLORS = {"masked": "#4c72b0", "oblivious": "#c44e52"}


def _panel(ax, view: dict, ylabel: str, title: str) -> None:
    """One view's curves (layer or EP step): per side the best list by K, every size captured dotted, the named
    lists as points."""
    for side, color in SIDE_COLORS.items():
        curve = view["sides"][side]["curve_us"]
        ax.plot(range(1, len(curve) + 1), [v / 1e3 for v in curve], color=color, label=f"{side}: best list")
        ax.axhline(view["sides"][side]["lower_bound_us"] / 1e3, color=color, lw=0.6, ls=":")
        for name, figs in view["named"].items():
            ax.scatter([figs["graphs"]], [figs[side]["time_us"] / 1e3], color=color, marker="o", s=18, zorder=3)
            ax.annotate(name, (figs["graphs"], figs[side]["time_us"] / 1e3), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("CUDA graphs captured (K)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def capture_search_plot(info: dict, path: Path) -> Path:
    """The layer's panel, and beside it the EP step's where the point priced it (its model's word in the title)."""
    cs = info["capture_search"]
    ep = cs.get("ep_step") or {}
    fig, axes = new_figure(1, 2 if ep.get("sides") else 1, panel_w=6.9, panel_h=3.6)
    _panel(axes[0][0], cs, "MoE-layer time over the trace (ms)",
           f"capture search: time vs graphs ({cs.get('card', '')}); dotted: every size captured")
    if ep.get("sides"):
        err = ep["sides"]["masked"]["noise_rel"]
        word = ep["noise_source"] + ("" if err is None else f" {err:.1%}")
        _panel(axes[0][1], ep, "EP step over the trace (ms)",
               f"the EP step: slowest of {info['engine']['ep_size']} EP ranks + wire\n{word}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def capture_search_figures(run: Run, out: Path) -> list[Plot]:
    """The run's capture-search figures (none for a run without a capture-search point)."""
    found = search_records(unique_records(run.records))  # a resumed run's repeats once, as the footer counts
    return [Plot("capture_search", path, f"capture search: time vs graphs, point {r.get('point')}", 1,
                 {"point": r.get("point")} if len(found) > 1 else {})
            for r, path in zip(found, plot_records(found, out))]


def plot_records(records: list[dict], out_dir: Path) -> list[Path]:
    """Each capture-search record's figure in out_dir: `capture_search.png`, or `capture_search__point<N>.png` for
    each of several points."""
    several = len(records) > 1
    return [capture_search_plot(r["info"], out_dir / (f"capture_search__point{r.get('point')}.png" if several
                                                     else "capture_search.png")) for r in records]
