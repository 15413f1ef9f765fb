"""Cumulative Triton compiles (and compile seconds) over a batch-size trace, per capacity policy, against the
predicted count."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, figure_title, param, slug, split
from moebench.plots.draw import Plot, new_figure, palette, save


def trace_steps(r: dict) -> list[dict] | None:
    steps = (r.get("info") or {}).get("trace_steps")
    if isinstance(steps, list) and steps and all(isinstance(s, dict) for s in steps):
        return steps
    return None


def compiles_counted(r: dict) -> bool:
    """False where the run could not count compiles (CPU / interpreter: "unsupported" or null per step): such a
    record has no compile curve to draw, and drawing its nulls as zeros would look like a perfect result."""
    if (r.get("info") or {}).get("observed_compiles") == "unsupported":
        return False
    return all(isinstance(s.get("compiles"), (int, float)) and not isinstance(s.get("compiles"), bool)
               for s in trace_steps(r) or [])


def cumulative(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def jit_compiles(run: Run, out: Path) -> list[Plot]:
    """`info.trace_steps[i]["compiles"]` / `["compile_s"]` are per step (this plot accumulates them);
    `info.predicted_compiles` is a total (horizontal line) or a per-step cumulative list."""
    recs = [r for r in run.ok if trace_steps(r) and param(r, "capacity_policy") is not None
            and compiles_counted(r)]
    if not recs:
        return []
    dims = ("capacity_policy", "impl")
    plots = []
    for group, rs in split(recs, dims):
        series = list(dict.fromkeys((r["impl"], param(r, "capacity_policy")) for r in rs))
        multi_impl = len({s[0] for s in series}) > 1
        colors = dict(zip(series, palette(len(series), "tab10")))
        has_seconds = any("compile_s" in s for r in rs for s in trace_steps(r))
        nrows = 3 if has_seconds else 2
        fig, axes = new_figure(nrows, 1, panel_w=8.0, panel_h=2.6, sharex=True)
        ax_c, ax_b = axes[0, 0], axes[-1, 0]
        ax_s = axes[1, 0] if has_seconds else None
        batch_drawn = False
        for key in series:
            r = next(x for x in rs if (x["impl"], param(x, "capacity_policy")) == key)
            steps = trace_steps(r)
            xs = [s.get("step", i) for i, s in enumerate(steps)]
            label = f"{key[0]} {key[1]}" if multi_impl else str(key[1])
            c = colors[key]
            ax_c.step(xs, cumulative([float(s.get("compiles") or 0) for s in steps]), where="post", color=c,
                      label=label)
            pred = (r.get("info") or {}).get("predicted_compiles")
            if isinstance(pred, (int, float)):
                ax_c.axhline(pred, color=c, ls="--", lw=1, alpha=0.8)
            elif isinstance(pred, list) and len(pred) == len(xs):
                ax_c.step(xs, pred, where="post", color=c, ls="--", lw=1, alpha=0.8)
            if ax_s is not None:
                ax_s.step(xs, cumulative([float(s.get("compile_s") or 0) for s in steps]), where="post",
                          color=c, label=label)
            if not batch_drawn and any("batch" in s for s in steps):
                ax_b.step(xs, [s.get("batch", 0) for s in steps], where="post", color="grey")
                batch_drawn = True
        from matplotlib.lines import Line2D

        handles, labels = ax_c.get_legend_handles_labels()
        handles.append(Line2D([], [], color="black", ls="--", lw=1))
        labels.append("predicted compiles")
        ax_c.legend(handles, labels, fontsize=7, loc="upper left")
        ax_c.set_ylabel("cumulative compiles")
        ax_c.set_ylim(bottom=0)
        if ax_s is not None:
            ax_s.set_ylabel("cumulative compile (s)")
            ax_s.set_ylim(bottom=0)
        ax_b.set_ylabel("batch (tokens)")
        ax_b.set_xlabel("trace step")
        for ax in axes.flat:
            ax.grid(True, alpha=0.3)
        title = figure_title(run, "JIT compiles over a batch-size trace", rs, dims, group)
        path = out / f"jit_compiles{slug(group)}.png"
        save(fig, path, title)
        plots.append(Plot("jit_compiles", path, title, len(rs), group))
    return plots
