"""PNG plots of a run directory, made from its stored records only (nothing is re-run).

`make_plots(run_dir)` writes into `plots/<run name>/` (next to the `results/` folder holding the run, else under
the current directory) every plot the records can feed, skipping the others quietly, plus `plots.json` (what
was drawn from how many points) and `index.md`. Only records with status "ok" are drawn.

Where a sweep varies parameters that a plot does not show (say top_k next to num_tokens and padding_ratio), the
plot is made once per combination of them, the values in its file name and title; `seed` and `repeat` are
folded instead (median of the repeated points).

Each figure family is one module; FIGURES below lists them. A new figure is one function
`make(run, out_dir) -> list[Plot]` (returning [] when the run's records cannot feed it) and one entry there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moebench.plots.capture_search import capture_search_figures
from moebench.plots.common import Run, default_plot_dir, gpu_label, load_run, ok_records
from moebench.plots.draw import Plot
from moebench.plots.jit import jit_compiles
from moebench.plots.latency import latency_vs_tokens
from moebench.plots.load import expert_load, rank_load
from moebench.plots.peers import peer_ratio
from moebench.plots.roof import roof_fraction
from moebench.plots.saving import saving_vs_padding
from moebench.plots.scaling import ep_scaling
from moebench.plots.stages import layer_stages
from moebench.plots.trace import ep_step_bars, ep_timeline, trace_cumulative, trace_tax, trace_tokens

__all__ = ["FIGURES", "KINDS", "Figure", "Plot", "Run", "default_plot_dir", "load_run", "make_plots", "ok_records",
           "plot_index"]


@dataclass(frozen=True)
class Figure:
    kind: str  # the stem of its file names (kind.png, kind__<group>.png)
    blurb: str  # the sentence the index shows under its images
    make: Callable[[Run, Path], list[Plot]]


# In the order the index lists them.
FIGURES: tuple[Figure, ...] = (
    Figure("latency_vs_tokens",
           "p50 latency vs tokens per rank (log-log), one line per padding ratio; masked solid, unmasked "
           "(mask=False, or the mask-oblivious twin impl in the same panel) dashed; band = p10..p90.",
           latency_vs_tokens),
    Figure("saving_vs_padding",
           "p50 with the padding mask / p50 without it (same impl at mask=False, or its mask-oblivious twin, e.g. "
           "layer.masked / layer.oblivious), vs padding ratio, one line per num_tokens; dashed: the same ratio of "
           "the roofline times (the ideal when only real work is done).",
           saving_vs_padding),
    Figure("expert_load",
           "Routes per expert (real vs padding, stacked) at the point with the largest padding share, masked vs "
           "unmasked.",
           expert_load),
    Figure("rank_load",
           "Routes per EP rank (real vs padding, stacked), slowest rank marked, at the point with the largest "
           "padding share.",
           rank_load),
    Figure("roof_fraction",
           "Achieved fraction of the roofline time (roofline_us / p50) per implementation vs num_tokens.",
           roof_fraction),
    Figure("layer_stages",
           "Layer p50 per stage (stacked) vs padding ratio, masked vs unmasked; black tick: the whole layer timed "
           "as one.",
           layer_stages),
    Figure("ep_scaling", "p50 vs EP size; hollow markers are simulated (computed) EP sizes.", ep_scaling),
    Figure("jit_compiles",
           "Cumulative Triton compiles (and compile seconds) over a batch-size trace per capacity policy; dashed: "
           "the predicted count. Runs that could not count compiles (CPU) are left out.",
           jit_compiles),
    Figure("peer_ratio",
           "Each impl's p50 over the fastest other peer's p50 at the same point (peers: torch.compile, library "
           "adapters, plugins; dashed) vs num_tokens, one panel per kernel family; below 1: faster than every peer.",
           peer_ratio),
    Figure("trace_tokens",
           "Serving trace: real tokens per step over all layer calls, and the padded rows each producer added "
           "(capture size, DP max, SP divisibility), stacked.",
           trace_tokens),
    Figure("trace_cumulative",
           "Serving trace: cumulative MoE-layer time over the steps, masked solid, oblivious dashed, one colour per "
           "capture list.",
           trace_cumulative),
    Figure("trace_tax",
           "Serving trace: the padding tax (layer time on padded rows over the layer time) per capture list, "
           "oblivious vs masked, each label with the model's word on the layer time (timed, its held-out error, "
           "unchecked); no bars where the two sides are not comparable.",
           trace_tax),
    Figure("ep_step_bars",
           "Serving trace, EP step: the mean rank's expert time, the wait for the slowest rank, dispatch and combine "
           "over the trace, stacked, masked vs oblivious per EP size; a black tick marks the step time (below the "
           "stack by the DBO overlap).",
           ep_step_bars),
    Figure("ep_timeline",
           "Serving trace, EP step: the step time and the wait for the slowest rank per step, masked vs oblivious, "
           "over a stretch of the trace.",
           ep_timeline),
    Figure("capture_search",
           "Capture search: the MoE layer's time over the trace against the CUDA graphs captured, the best list of at "
           "most K sizes per side (masked, oblivious), the named capture lists as points; dotted: every candidate "
           "size captured.",
           capture_search_figures),
)

KINDS: dict[str, str] = {f.kind: f.blurb for f in FIGURES}  # kind -> blurb


def make_plots(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Every plot the run's ok records can feed, as PNGs in `out_dir` (default plots/<run name>/).

    Also writes `plots.json` (kind, file, title, points drawn) and `index.md`. Earlier PNGs of these kinds in the
    folder are removed first, so a re-plot after a resumed run leaves no stale files.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else default_plot_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        for old in out.glob(f"{kind}*.png"):
            old.unlink()
    made: list[Plot] = []
    for figure in FIGURES:
        made += figure.make(run, out)
    meta = {"run": run.name, "run_dir": str(Path(run_dir).resolve()), "sweep": run.sweep_name,
            "gpu": gpu_label(run.manifest),
            "records": {s: sum(1 for r in run.records if r.get("status") == s)
                        for s in ("ok", "wrong", "skipped", "failed")},
            "unreadable_lines": run.bad_lines,
            "plots": [{"kind": p.kind, "file": p.path.name, "title": p.title, "points": p.points,
                       "group": p.group} for p in made]}
    (out / "plots.json").write_text(json.dumps(meta, indent=2, default=str))
    plot_index(run_dir, out)
    return [p.path for p in made]


def plot_index(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write `<plots>/index.md` listing the run's images (from plots.json when present, else the PNGs found)."""
    out = Path(out_dir) if out_dir is not None else default_plot_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "plots.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        entries = [p for p in meta.get("plots", []) if (out / p["file"]).exists()]
    else:
        run = load_run(run_dir)
        meta = {"run": run.name, "sweep": run.sweep_name, "gpu": gpu_label(run.manifest), "records": {}}
        entries = [{"kind": next((k for k in KINDS if f.name.startswith(k)), ""), "file": f.name,
                    "title": f.stem, "points": None} for f in sorted(out.glob("*.png"))]
    lines = [f"# Plots of run `{meta.get('run')}`", "",
             f"Sweep `{meta.get('sweep')}` on {meta.get('gpu')}. Made from the stored records only "
             "(status ok; failed, wrong and skipped points are left out)."]
    counts = meta.get("records") or {}
    if counts:
        lines.append("Records: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".")
    if not entries:
        lines += ["", "No plot could be made from these records."]
    for kind, blurb in KINDS.items():
        files = [e for e in entries if e.get("kind") == kind]
        if not files:
            continue
        lines += ["", f"## {kind.replace('_', ' ')}", "", blurb, ""]
        for e in files:
            caption = e["title"].replace("\n", " - ")
            pts = f" ({e['points']} points)" if e.get("points") is not None else ""
            lines += [f"- `{e['file']}`{pts}: {caption}", "", f"  ![{kind}]({e['file']})", ""]
    path = out / "index.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
