"""The figures of a run on the report page: found where `moebench plot` / `moebench run` put them, else drawn from
the run's records (moebench.plots), so that a page stands alone for runs that keep records only (the committed
reference runs under results/).

Found: <run_dir>/plots first, then plots/<run name> beside the run's results folder (<repo>/results/<run> ->
<repo>/plots/<run>), then plots/<run name> under the current directory. Drawn: into <run_dir>/plots when the run
directory can be written, else into the scratch folder the page gives (a temporary folder for HTML, whose images
are embedded; a folder beside the Markdown file, which links them).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["find_plots", "draw_plots", "writable_plot_dir", "scratch_dir_for"]


def _plot_dirs(run_dir: Path) -> list[Path]:
    return [run_dir / "plots", run_dir.resolve().parent.parent / "plots" / run_dir.name, Path("plots") / run_dir.name]


def find_plots(run_dir: Path) -> list[Path]:
    """The run's PNGs from the first plot folder that has any (see the module docstring for the order)."""
    for d in _plot_dirs(run_dir):
        pngs = sorted(d.glob("*.png")) if d.is_dir() else []
        if pngs:
            return pngs
    return []


def writable_plot_dir(run_dir: Path) -> Path | None:
    """<run_dir>/plots when files can be written there (made if missing), else None."""
    target = run_dir / "plots"
    made = not target.exists()
    try:
        target.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target):
            pass
        return target
    except OSError:
        if made:
            try:
                target.rmdir()
            except OSError:
                pass
        return None


def draw_plots(run_dir: Path, scratch: Path) -> tuple[list[Path], str]:
    """(the PNGs drawn from the run's records, a sentence saying where, or why none); into <run_dir>/plots when
    writable, else into scratch/<run name>."""
    from moebench.plots import make_plots

    target = writable_plot_dir(run_dir) or scratch / run_dir.resolve().name
    try:
        paths = make_plots(run_dir, target)
    except Exception as e:  # a figure that cannot be drawn costs the figures, never the page
        why = (str(e).strip().splitlines() or [""])[0][:200]
        return [], f"The figures could not be drawn from the records: {type(e).__name__}: {why}"
    if not paths:
        return [], "No figure can be drawn from this run's records."
    where = f"into {target}" if target.parent != scratch else "for this page only (the run directory is read-only)"
    return sorted(paths), f"Drawn from the stored records {where}."


def scratch_dir_for(out: Path) -> Path:
    """Where a Markdown page keeps the figures it had to draw: a folder beside it, named after it."""
    return out.parent / f"{out.stem}-plots"
