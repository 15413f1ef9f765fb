"""Figure plumbing shared by every plot: no pyplot (no global state, no GUI backend)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from moebench.plots.common import Run, figure_title, fmt_value, slug


@dataclass
class Plot:
    """One written image: its kind, file, title and how many records were drawn in it (for plots.json)."""
    kind: str
    path: Path
    title: str
    points: int
    group: dict = field(default_factory=dict)


def new_figure(nrows: int, ncols: int, panel_w: float = 5.0, panel_h: float = 3.8, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_w * ncols + 0.6, panel_h * nrows + 0.9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def grid_shape(n: int, max_cols: int = 3) -> tuple[int, int]:
    """(rows, columns) for n panels."""
    cols = min(n, max_cols)
    return (n + cols - 1) // cols, cols


def save(fig, path: Path, title: str) -> None:
    width_chars = int(fig.get_size_inches()[0] * 12.5)  # ~ characters of a 10 pt title per inch
    lines = [textwrap.fill(line, width_chars) for line in title.split("\n")]
    fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def panel_figure(panels: int, max_cols: int = 3, **kw):
    """(fig, axes) of a grid_shape grid for `panels` panels; new_figure's keywords passed on."""
    nrows, ncols = grid_shape(panels, max_cols)
    return new_figure(nrows, ncols, **kw)


def save_panels(fig, axes, panels: int, run: Run, out: Path, kind: str, what: str, records: list[dict], dims,
                group: dict) -> Plot:
    """A panel figure finished: the panels past `panels` hidden, titled (figure_title over `records`, those
    drawn) and saved as out/<kind><slug(group)>.png; its Plot."""
    hide_unused(axes, panels)
    title = figure_title(run, what, records, dims, group)
    path = out / f"{kind}{slug(group)}.png"
    save(fig, path, title)
    return Plot(kind, path, title, len(records), group)


def hide_unused(axes, used: int) -> None:
    for i, ax in enumerate(axes.flat):
        if i >= used:
            ax.set_visible(False)


def log2_ticks(ax, values: list[float], axis: str = "x") -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    vals = sorted(set(values))
    if len(vals) > 12:  # too many to label: every other one
        vals = vals[::2]
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(vals))
    target.set_minor_locator(NullLocator())
    (ax.set_xticklabels if axis == "x" else ax.set_yticklabels)([fmt_value(v) for v in vals], fontsize=8)


def palette(n: int, cmap: str = "viridis") -> list:
    import matplotlib

    cm = matplotlib.colormaps[cmap]
    if cmap.startswith("tab"):  # qualitative: distinct colours in order
        return [cm(i % cm.N) for i in range(n)]
    if n == 1:
        return [cm(0.35)]
    return [cm(0.05 + 0.8 * i / (n - 1)) for i in range(n)]
