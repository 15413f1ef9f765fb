"""PNG plots of a run directory, made from its stored records only (nothing is re-run).

`make_plots(run_dir)` writes into `plots/<run name>/` (next to the `results/` folder holding the run, else under
the current directory) every plot the records can feed, skipping the others quietly, plus `plots.json` (what
was drawn from how many points) and `index.md`. Only records with status "ok" are drawn.

Where a sweep varies parameters that a plot does not show (say top_k next to num_tokens and padding_ratio), the
plot is made once per combination of them, the values in its file name and title; `seed` and `repeat` are
folded instead (median of the repeated points).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

# Each plot kind: file-name stem and the sentence the index shows under it.
KINDS: dict[str, str] = {
    "latency_vs_tokens": "p50 latency vs tokens per rank (log-log), one line per padding ratio; masked solid, "
                         "unmasked (mask=False, or the mask-oblivious twin impl in the same panel) dashed; "
                         "band = p10..p90.",
    "saving_vs_padding": "p50 with the padding mask / p50 without it (same impl at mask=False, or its "
                         "mask-oblivious twin, e.g. layer.masked / layer.oblivious), vs padding ratio, one line per "
                         "num_tokens; dashed: the same ratio of the roofline times (the ideal when only real work "
                         "is done).",
    "expert_load": "Routes per expert (real vs padding, stacked) at the point with the largest padding share, "
                   "masked vs unmasked.",
    "rank_load": "Routes per EP rank (real vs padding, stacked), slowest rank marked, at the point with the "
                 "largest padding share.",
    "roof_fraction": "Achieved fraction of the roofline time (roofline_us / p50) per implementation vs num_tokens.",
    "layer_stages": "Layer p50 per stage (stacked) vs padding ratio, masked vs unmasked; black tick: the whole "
                    "layer timed as one.",
    "ep_scaling": "p50 vs EP size; hollow markers are simulated (computed) EP sizes.",
    "jit_compiles": "Cumulative Triton compiles (and compile seconds) over a batch-size trace per capacity "
                    "policy; dashed: the predicted count. Runs that could not count compiles (CPU) are left out.",
}

FOLDED = ("seed", "repeat")  # repeated measurements of one point: aggregated (median), never split on
MAX_FIGURES_PER_KIND = 24  # a sweep with many extra axes still gets a bounded number of files

# Parameters worth naming in a title when they are constant across the plotted points, with short labels.
_TITLE_KEYS = (("num_experts", "E"), ("top_k", "top_k"), ("hidden", "H"), ("intermediate", "I"),
               ("dtype", ""), ("padding_producer", "producer"), ("padding_fill", "fill"), ("routing", "routing"),
               ("num_tokens", "T"), ("padding_ratio", "pad"), ("mask", "mask"), ("ep_size", "EP"),
               ("capacity_policy", "capacity"), ("scoring", "scoring"), ("num_expert_group", "groups"))


# ---------------------------------------------------------------------------------------------------------------
# Reading a run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    path: Path
    name: str
    manifest: dict
    records: list[dict]  # every parsed record, any status
    bad_lines: int = 0

    @property
    def ok(self) -> list[dict]:
        return ok_records(self.records)

    @property
    def sweep_name(self) -> str:
        sweep = self.manifest.get("sweep") or {}
        return str(sweep.get("name") or self.name)


def ok_records(records: Iterable[dict]) -> list[dict]:
    """Records that may be drawn: status ok with parameters (failed, wrong and skipped ones never are)."""
    return [r for r in records if r.get("status") == "ok" and isinstance(r.get("params"), dict)]


def load_run(run_dir: str | os.PathLike) -> Run:
    run_dir = Path(run_dir)
    records_path = run_dir / "records.jsonl"
    if not records_path.exists():
        raise FileNotFoundError(f"{run_dir}: no records.jsonl (not a run directory)")
    manifest: dict = {}
    if (run_dir / "manifest.json").exists():
        manifest = json.loads((run_dir / "manifest.json").read_text())
    records, bad = [], 0
    for line in records_path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # a torn last line of an interrupted run: its point is simply not drawn
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return Run(run_dir, run_dir.resolve().name, manifest, records, bad)


def default_plot_dir(run_dir: str | os.PathLike) -> Path:
    """plots/<run name>/: beside the results/ folder that holds the run, else under the current directory."""
    run_dir = Path(run_dir).resolve()
    base = run_dir.parent.parent if run_dir.parent.name == "results" else Path.cwd()
    return base / "plots" / run_dir.name


# ---------------------------------------------------------------------------------------------------------------
# Small helpers over records
# ---------------------------------------------------------------------------------------------------------------


def _param(r: dict, key: str) -> Any:
    return (r.get("params") or {}).get(key)


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def _varying(records: list[dict], exclude: Iterable[str] = ()) -> list[str]:
    """Parameter names (plus "impl") whose value differs between records, in params order."""
    skip = set(exclude) | set(FOLDED)
    keys: list[str] = []
    for r in records:
        for k in (r.get("params") or {}):
            if k not in keys:
                keys.append(k)
    out = [k for k in keys if k not in skip and len({_hashable(_param(r, k)) for r in records}) > 1]
    if "impl" not in skip and len({r.get("impl") for r in records}) > 1:
        out.append("impl")
    return out


def _get(r: dict, key: str) -> Any:
    return r.get("impl") if key == "impl" else _param(r, key)


def _split(records: list[dict], dims: Iterable[str]) -> list[tuple[dict, list[dict]]]:
    """Group records on every varying parameter that is not one of the plot's own `dims`."""
    extra = _varying(records, exclude=dims)
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(_hashable(_get(r, k)) for k in extra), []).append(r)

    def order(item: tuple) -> tuple:
        return tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in item[0])

    out = [({k: _get(rs[0], k) for k in extra}, rs) for _, rs in sorted(groups.items(), key=order)]
    return out[:MAX_FIGURES_PER_KIND]


def _p(r: dict, stat: str = "p50") -> float | None:
    v = (r.get("stats") or {}).get(stat)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _label_of(values: dict) -> str:
    short = dict(_TITLE_KEYS)
    return ", ".join(f"{short.get(k) or k}={_fmt_value(v)}" for k, v in values.items())


def _slug(values: dict) -> str:
    if not values:
        return ""
    s = "__" + "_".join(f"{k}-{_fmt_value(v)}" for k, v in values.items())
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", s)[:120]


def _gpu_label(manifest: dict) -> str:
    env = manifest.get("env") or {}
    if env.get("gpu") and str(manifest.get("device", "cuda")).startswith("cuda"):
        return str(env["gpu"])  # the runner's manifest: env.gpu names the device the points ran on
    gpu = manifest.get("gpu")
    if isinstance(gpu, str) and gpu:
        return gpu
    if isinstance(gpu, dict):
        name = gpu.get("name") or gpu.get("device_name")
        names = gpu.get("names") or [d.get("name") for d in gpu.get("devices", []) if isinstance(d, dict)]
        if not name and names:
            name = names[0]
        count = gpu.get("count") or (len(names) if names else None)
        if name:
            return f"{count}x {name}" if isinstance(count, int) and count > 1 else str(name)
    return "CPU (no GPU)"


def _constant_params(records: list[dict], skip: Iterable[str], fixed_keys: Iterable[str] = ()) -> str:
    """The parameters that matter and are the same for every plotted point: those the sweep fixed (its `fixed`
    section), plus the expert count and top_k, in a stable order with short labels."""
    skip = set(skip)
    short = dict(_TITLE_KEYS)
    wanted = ["num_experts", "top_k"] + [k for k in fixed_keys if k not in ("num_experts", "top_k")]
    if not list(fixed_keys):  # no manifest: fall back to the usual suspects
        wanted += [k for k, _ in _TITLE_KEYS if k not in wanted]
    order = [k for k, _ in _TITLE_KEYS]
    wanted.sort(key=lambda k: order.index(k) if k in order else len(order))
    parts = []
    for key in wanted:
        if key in skip or key in FOLDED:
            continue
        values = {_hashable(_param(r, key)) for r in records}
        if len(values) != 1:
            continue
        v = _param(records[0], key)
        if v is None or (key == "padding_producer" and v == "ratio") or (key == "ep_size" and v == 1):
            continue
        if isinstance(v, list):
            v = ",".join(map(str, v[:6])) + (",..." if len(v) > 6 else "")
        label = short.get(key, key)
        parts.append(f"{label}={_fmt_value(v)}" if label else _fmt_value(v))
    modes = {r.get("timing_mode") for r in records if r.get("timing_mode")}
    if len(modes) == 1:
        parts.append(f"timing: {modes.pop()}")
    return ", ".join(parts)


def _title(run: Run, what: str, records: list[dict], dims: Iterable[str], group: dict) -> str:
    line1 = f"{what} - sweep {run.sweep_name} on {_gpu_label(run.manifest)}"
    fixed_keys = list(((run.manifest.get("sweep") or {}).get("fixed") or {}).keys())
    fixed = _constant_params(records, set(dims) | set(group), fixed_keys)
    line2 = "; ".join(s for s in (_label_of(group), fixed) if s)
    return line1 + ("\n" + line2 if line2 else "")


def _aggregate(records: list[dict], key: Callable[[dict], Any]) -> dict[Any, dict[str, float | None]]:
    """Median over records sharing `key` (repeats / seeds) of p50, p10, p90, roofline_us, roof_fraction."""
    buckets: dict[Any, list[dict]] = {}
    for r in records:
        buckets.setdefault(key(r), []).append(r)
    out = {}
    for k, rs in buckets.items():
        out[k] = {"p50": _median([_p(r, "p50") for r in rs]), "p10": _median([_p(r, "p10") for r in rs]),
                  "p90": _median([_p(r, "p90") for r in rs]),
                  "roofline_us": _median([r.get("roofline_us") for r in rs
                                          if isinstance(r.get("roofline_us"), (int, float))]),
                  "roof_fraction": _median([r.get("roof_fraction") for r in rs
                                            if isinstance(r.get("roof_fraction"), (int, float))]),
                  "simulated": any(_simulated(r) for r in rs), "n": len(rs)}
    return out


def _simulated(r: dict) -> bool:
    ranks = r.get("ranks")
    if isinstance(ranks, dict) and "simulated" in ranks:
        return bool(ranks["simulated"])
    return _param(r, "ep_mode") == "simulated"


def _sorted_unique(values: Iterable[Any]) -> list[Any]:
    vals = {v for v in values if v is not None}
    return sorted(vals, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))


# ---------------------------------------------------------------------------------------------------------------
# Figure plumbing (no pyplot: no global state, no GUI backend)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Plot:
    kind: str
    path: Path
    title: str
    points: int
    group: dict = field(default_factory=dict)


def _figure(nrows: int, ncols: int, panel_w: float = 5.0, panel_h: float = 3.8, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_w * ncols + 0.6, panel_h * nrows + 0.9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(n, max_cols)
    return (n + cols - 1) // cols, cols


def _save(fig, path: Path, title: str) -> None:
    width_chars = int(fig.get_size_inches()[0] * 12.5)  # ~ characters of a 10 pt title per inch
    lines = [textwrap.fill(line, width_chars) for line in title.split("\n")]
    fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _hide_unused(axes, used: int) -> None:
    for i, ax in enumerate(axes.flat):
        if i >= used:
            ax.set_visible(False)


def _log2_ticks(ax, values: list[float], axis: str = "x") -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    vals = sorted(set(values))
    if len(vals) > 12:  # too many to label: every other one
        vals = vals[::2]
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(vals))
    target.set_minor_locator(NullLocator())
    (ax.set_xticklabels if axis == "x" else ax.set_yticklabels)([_fmt_value(v) for v in vals], fontsize=8)


def _colors(n: int, cmap: str = "viridis") -> list:
    import matplotlib

    cm = matplotlib.colormaps[cmap]
    if cmap.startswith("tab"):  # qualitative: distinct colours in order
        return [cm(i % cm.N) for i in range(n)]
    if n == 1:
        return [cm(0.35)]
    return [cm(0.05 + 0.8 * i / (n - 1)) for i in range(n)]


# Per mode (see _mode_of): masked solid, unmasked dashed, the mask-oblivious twin dashed too unless it shares a
# panel with an unmasked (mask=False) line, then dash-dot (see _mode_styles).
_MODE_STYLE = {"masked": "-", "unmasked": "--", "oblivious": "--", None: "-"}
_MODE_ORDER = ("masked", "unmasked", "oblivious", None)
# Variants preferred as the mask-aware partner of an oblivious twin when a kernel has several mask-aware impls
# (fused_experts.triton, not the eager fused_experts.torch reference).
_TWIN_VARIANTS = ("masked", "triton")


def _mode_of(r: dict) -> str | None:
    """"masked" / "unmasked" for a mask-aware impl run with mask=True / False, "oblivious" for a mask-oblivious
    twin (record mask_aware false: it ignores the mask param, so that param says nothing), None otherwise."""
    if r.get("mask_aware") is False:
        return "oblivious"
    m = _param(r, "mask")
    return ("masked" if m else "unmasked") if isinstance(m, bool) else None


def _mask_of(r: dict) -> bool | None:
    """True: padded rows skipped; False: computed like real ones (mask=False or a mask-oblivious impl)."""
    mode = _mode_of(r)
    return None if mode is None else mode == "masked"


def _kernel_of(r: dict) -> str:
    return str(r.get("kernel") or str(r.get("impl", "")).split(".", 1)[0])


def _twin_impls(records: list[dict]) -> dict[str, str]:
    """Mask-oblivious impl -> its mask-aware twin among these records: the same kernel, variant "masked" or
    "triton" first, else the kernel's only mask-aware impl. Oblivious impls without a twin are left out."""
    aware: dict[str, list[str]] = {}
    oblivious: dict[str, str] = {}
    for r in records:
        impl = r.get("impl")
        if r.get("mask_aware") is False:
            oblivious.setdefault(impl, _kernel_of(r))
        elif impl not in aware.setdefault(_kernel_of(r), []):
            aware[_kernel_of(r)].append(impl)
    out = {}
    for impl, kernel in oblivious.items():
        cands = aware.get(kernel, [])
        pick = next((c for v in _TWIN_VARIANTS for c in cands if c.split(".", 1)[-1] == v), None)
        if pick is None and len(cands) == 1:
            pick = cands[0]
        if pick is not None:
            out[impl] = pick
    return out


def _panels(records: list[dict]) -> dict[str, str]:
    """impl -> panel name: a mask-aware impl and its oblivious twin share one panel ("A vs B"), others their own."""
    twins = _twin_impls(records)
    joined: dict[str, list[str]] = {}
    for r in records:
        base = twins.get(r["impl"], r["impl"])
        if r["impl"] not in joined.setdefault(base, [base]):
            joined[base].append(r["impl"])
    return {impl: " vs ".join(members) for members in joined.values() for impl in members}


def _mode_styles(records: list[dict]) -> dict[str | None, str]:
    styles = dict(_MODE_STYLE)
    modes = {_mode_of(r) for r in records}
    if "unmasked" in modes and "oblivious" in modes:
        styles["oblivious"] = "-."
    return styles


def _series_label(impl: str, mode: str | None) -> str:
    """impl plus its mode word, unless the impl's own name already says it (layer.masked, x.oblivious)."""
    variant = impl.split(".", 1)[-1]
    if mode is None or variant == mode:
        return impl
    return f"{impl} {'mask-oblivious' if mode == 'oblivious' else mode}"


# ---------------------------------------------------------------------------------------------------------------
# The plots
# ---------------------------------------------------------------------------------------------------------------


def _latency_vs_tokens(run: Run, out: Path) -> list[_Plot]:
    recs = [r for r in run.ok if _p(r) is not None and _param(r, "num_tokens") is not None]
    if len({_param(r, "num_tokens") for r in recs}) < 2:
        return []
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in _split(recs, dims):
        if len({_param(r, "num_tokens") for r in rs}) < 2:
            continue
        panel_of = _panels(rs)  # a mask-aware impl and its oblivious twin share a panel
        panels = list(dict.fromkeys(panel_of[r["impl"]] for r in rs))
        styles = _mode_styles(rs)
        ratios = _sorted_unique(_param(r, "padding_ratio") for r in rs) or [None]
        colors = dict(zip(ratios, _colors(len(ratios))))
        nrows, ncols = _grid(len(panels))
        fig, axes = _figure(nrows, ncols, sharey=True)
        for ax, panel in zip(axes.flat, panels):
            agg = _aggregate([r for r in rs if panel_of[r["impl"]] == panel],
                             lambda r: (_param(r, "padding_ratio"), _mode_of(r), _param(r, "num_tokens")))
            for ratio in ratios:
                for mode in _MODE_ORDER:
                    pts = sorted((k[2], v) for k, v in agg.items() if k[0] == ratio and k[1] == mode)
                    if not pts:
                        continue
                    xs = [x for x, _ in pts]
                    label = f"pad {_fmt_value(ratio)}" + (f", {mode}" if mode is not None else "")
                    ax.plot(xs, [v["p50"] for _, v in pts], styles[mode], marker="o", ms=3,
                            color=colors[ratio], label=label)
                    band = [(x, v["p10"], v["p90"]) for x, v in pts if v["p10"] and v["p90"]]
                    if len(band) >= 2:
                        ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                                        color=colors[ratio], alpha=0.12, linewidth=0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            _log2_ticks(ax, [_param(r, "num_tokens") for r in rs])
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("num_tokens (rows per rank)")
            ax.grid(True, which="both", alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("latency p50 (us), band p10-p90")
        axes.flat[0].legend(fontsize=7, loc="upper left")
        _hide_unused(axes, len(panels))
        title = _title(run, "Latency vs tokens", rs, dims, group)
        path = out / f"latency_vs_tokens{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("latency_vs_tokens", path, title, len(rs), group))
    return plots


def _saving_pairs(records: list[dict], twins: dict[str, str]) -> tuple[dict[tuple, tuple[float, float | None]],
                                                                      set[tuple]]:
    """{(panel, num_tokens, padding_ratio): (p50 masked / p50 partner, roofline_us ratio or None)} over records of
    one figure (other params equal), and the (impl, num_tokens, ratio, mode) keys that went into a pair."""
    agg = _aggregate(records, lambda r: (r["impl"], _param(r, "num_tokens"), _param(r, "padding_ratio"),
                                         _mode_of(r)))
    pairs: dict[tuple, tuple[float, float | None]] = {}
    used_keys: set[tuple] = set()
    for (impl, tokens, ratio, mode), v in agg.items():
        if mode in ("oblivious", "unmasked") or not v["p50"]:
            continue
        refs = []
        if mode == "masked":
            refs.append((f"{impl}: mask on / off", (impl, tokens, ratio, "unmasked")))
        # the oblivious twin's partner: the impl at mask=True, or without a mask param (then it always masks)
        refs += [(f"{impl} / {o}", (o, tokens, ratio, "oblivious")) for o, a in twins.items() if a == impl]
        for panel, ref_key in refs:
            other = agg.get(ref_key)
            if not other or not other["p50"]:
                continue
            roof = v["roofline_us"] / other["roofline_us"] if v["roofline_us"] and other["roofline_us"] else None
            pairs[(panel, tokens, ratio)] = (v["p50"] / other["p50"], roof)
            used_keys |= {(impl, tokens, ratio, mode), ref_key}
    return pairs, used_keys


def _saving_vs_padding(run: Run, out: Path) -> list[_Plot]:
    """Pairs a masked point with its unmasked partner at otherwise equal params: the same mask-aware impl at
    mask=False, or the impl's mask-oblivious twin (layer.masked vs layer.oblivious)."""
    recs = [r for r in run.ok if _p(r) is not None]
    twins = _twin_impls(recs)
    recs = [r for r in recs if _mode_of(r) is not None or r["impl"] in twins.values()]
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in _split(recs, dims):
        pairs, used_keys = _saving_pairs(rs, twins)
        if not pairs:
            continue
        panels = list(dict.fromkeys(k[0] for k in pairs))
        tokens_all = _sorted_unique(k[1] for k in pairs)
        colors = dict(zip(tokens_all, _colors(len(tokens_all), "plasma")))
        ratios_all = _sorted_unique(k[2] for k in pairs)
        nrows, ncols = _grid(len(panels))
        fig, axes = _figure(nrows, ncols, sharey=True)
        for ax, panel in zip(axes.flat, panels):
            ideal_labelled = False
            for tokens in tokens_all:
                pts = sorted((k[2], v) for k, v in pairs.items() if k[0] == panel and k[1] == tokens)
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                ax.plot(xs, [v[0] for _, v in pts], "-", marker="o", ms=3, color=colors[tokens],
                        label=f"T={tokens}")
                roof = [(x, v[1]) for x, v in pts if v[1] is not None]
                if roof:
                    ax.plot([x for x, _ in roof], [y for _, y in roof], "--", color=colors[tokens], alpha=0.8,
                            label=None if ideal_labelled else "ideal: roofline ratio (real work only)")
                    ideal_labelled = True
            lo, hi = min(ratios_all), max(ratios_all)
            grid = [lo + (hi - lo) * i / 20 for i in range(21)] if hi > lo else [lo]
            ax.plot(grid, [1 - x for x in grid], ":", color="grey", label="1 - padding ratio")
            ax.axhline(1.0, color="black", lw=0.8, alpha=0.5)
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("padding ratio (share of rows that are padding)")
            ax.grid(True, alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("p50 masked / p50 unmasked or oblivious\n(lower = saving)")
        axes.flat[0].legend(fontsize=7)
        _hide_unused(axes, len(panels))
        used = [r for r in rs if (r["impl"], _param(r, "num_tokens"), _param(r, "padding_ratio"), _mode_of(r))
                in used_keys]
        title = _title(run, "Saving from the padding mask", used, dims, group)
        path = out / f"saving_vs_padding{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("saving_vs_padding", path, title, len(used), group))
    return plots


def _padding_share(loads_real: list, loads_pad: list) -> float:
    total = sum(loads_real) + sum(loads_pad)
    return sum(loads_pad) / total if total else 0.0


def _twin(records: list[dict], rec: dict) -> dict | None:
    """The masked / unmasked partner of `rec` at otherwise equal params: the same impl with the mask flipped, else
    the impl's mask-aware or mask-oblivious twin (layer.masked <-> layer.oblivious)."""
    mode = _mode_of(rec)
    twins = _twin_impls(records)
    if mode == "masked":
        wanted = [(rec["impl"], ("unmasked",))] + [(o, ("oblivious",)) for o, a in twins.items() if a == rec["impl"]]
    elif mode == "unmasked":
        wanted = [(rec["impl"], ("masked",))]
    elif mode == "oblivious" and rec["impl"] in twins:
        wanted = [(twins[rec["impl"]], ("masked", None))]
    else:
        return None
    same = {k: _hashable(v) for k, v in rec["params"].items() if k != "mask"}
    for impl, modes in wanted:
        for r in records:
            if r["impl"] == impl and _mode_of(r) in modes and \
                    {k: _hashable(v) for k, v in r["params"].items() if k != "mask"} == same:
                return r
    return None


def _pick_load_pair(records: list[dict], real_key: str, pad_key: str) -> list[dict]:
    """[masked, unmasked] (or the one record) for the point whose routes carry the largest padding share."""
    def share(r: dict) -> tuple:
        imb = r["imbalance"]
        return (_padding_share(imb[real_key], imb[pad_key]), _param(r, "padding_ratio") or 0,
                _param(r, "num_tokens") or 0)

    best = max(records, key=share)
    twin = _twin(records, best)
    pair = [best] + ([twin] if twin else [])
    return sorted(pair, key=lambda r: _mask_of(r) is False)  # masked first (left)


def _load_bars(run: Run, out: Path, kind: str, real_key: str, pad_key: str, split_key: str,
               wants: Callable[[dict], bool]) -> list[_Plot]:
    recs = []
    for r in run.ok:
        imb = r.get("imbalance")
        if isinstance(imb, dict) and isinstance(imb.get(real_key), list) and isinstance(imb.get(pad_key), list) \
                and len(imb[real_key]) == len(imb[pad_key]) and imb[real_key] and wants(r):
            recs.append(r)
    plots = []
    by_size: dict[int, list[dict]] = {}
    for r in recs:
        by_size.setdefault(len(r["imbalance"][real_key]), []).append(r)
    for size in sorted(by_size)[:4]:
        pair = _pick_load_pair(by_size[size], real_key, pad_key)
        fig, axes = _figure(1, len(pair), panel_w=6.0 if size > 32 else 4.5, sharey=True)
        for ax, r in zip(axes.flat, pair):
            imb = r["imbalance"]
            real, pad = imb[real_key], imb[pad_key]
            xs = list(range(size))
            width = 1.0 if size > 64 else 0.8
            ax.bar(xs, real, width=width, color="tab:blue", label="real token routes")
            ax.bar(xs, pad, width=width, bottom=real, color="tab:orange", label="padding routes")
            totals = [a + b for a, b in zip(real, pad)]
            mean = sum(totals) / size
            ax.axhline(mean, color="black", ls="--", lw=0.8, label=f"mean {mean:.0f}")
            stats = imb.get("rank" if kind == "rank_load" else "expert") or {}
            if kind == "rank_load":
                slow = stats.get("slowest_rank")
                if not isinstance(slow, int) or not 0 <= slow < size:
                    slow = max(range(size), key=lambda i: totals[i])
                ax.bar([slow], [totals[slow]], width=width, fill=False, edgecolor="red", lw=2,
                       label=f"slowest rank {slow}")
                ax.annotate("slowest", (slow, totals[slow]), ha="center", va="bottom", color="red", fontsize=8)
                ax.set_xlabel("EP rank")
                ax.set_xticks(xs)
                ax.set_ylabel("routes received (token-expert pairs)")
            else:
                hot = stats.get("hottest")
                if not isinstance(hot, int) or not 0 <= hot < size:
                    hot = max(range(size), key=lambda i: totals[i])
                ax.annotate(f"hottest: expert {hot}", (hot, totals[hot]), ha="center", va="bottom",
                            color="red", fontsize=8)
                ax.set_xlabel("expert id")
                ax.set_ylabel("routes per expert (token-expert pairs)")
            mom = max(totals) / mean if mean else float("nan")
            share = _padding_share(real, pad)
            where = f"T={_param(r, 'num_tokens')}, padding ratio {_fmt_value(_param(r, 'padding_ratio'))}"
            ax.set_title(f"{_series_label(r['impl'], _mode_of(r))} ({where})\npadding share of routes {share:.0%}, "
                         f"max/mean {mom:.2f}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
        what = "Per-rank load" if kind == "rank_load" else "Per-expert load"
        if kind == "rank_load":
            what += " (computed from the routing" + (", simulated ranks)" if any(_simulated(r) for r in pair)
                                                     else ")")
        dims = ("mask", "impl")
        title = _title(run, what, pair, dims, {})
        path = out / f"{kind}__{split_key}-{size}.png"
        _save(fig, path, title)
        plots.append(_Plot(kind, path, title, len(pair), {split_key: size}))
    return plots


def _expert_load(run: Run, out: Path) -> list[_Plot]:
    return _load_bars(run, out, "expert_load", "per_expert_real", "per_expert_padding", "num_experts",
                      lambda r: True)


def _rank_load(run: Run, out: Path) -> list[_Plot]:
    def multi_rank(r: dict) -> bool:
        imb = r["imbalance"]
        ep = imb.get("ep_size") or _param(r, "ep_size") or 1
        return ep > 1 and len(imb.get("per_rank_real") or []) > 1

    return _load_bars(run, out, "rank_load", "per_rank_real", "per_rank_padding", "ep_size", multi_rank)


def _roof_fraction(run: Run, out: Path) -> list[_Plot]:
    recs = [r for r in run.ok if isinstance(r.get("roof_fraction"), (int, float)) and r["roof_fraction"] > 0
            and _param(r, "num_tokens") is not None]
    if not recs:
        return []
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in _split(recs, dims):
        ratios = _sorted_unique(_param(r, "padding_ratio") for r in rs) or [None]
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        colors = dict(zip(impls, _colors(len(impls), "tab10")))
        styles = _mode_styles(rs)
        nrows, ncols = _grid(len(ratios))
        fig, axes = _figure(nrows, ncols, sharey=True)
        for ax, ratio in zip(axes.flat, ratios):
            sub = [r for r in rs if _param(r, "padding_ratio") == ratio]
            agg = _aggregate(sub, lambda r: (r["impl"], _mode_of(r), _param(r, "num_tokens")))
            for impl in impls:
                for mode in _MODE_ORDER:
                    pts = sorted((k[2], v["roof_fraction"]) for k, v in agg.items()
                                 if k[0] == impl and k[1] == mode and v["roof_fraction"])
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], styles[mode], marker="o", ms=3,
                                color=colors[impl], label=_series_label(impl, mode))
            ax.axhline(1.0, color="black", lw=0.8, alpha=0.5)
            ax.set_xscale("log", base=2)
            _log2_ticks(ax, [_param(r, "num_tokens") for r in rs])
            ax.set_ylim(bottom=0)
            ax.set_title(f"padding ratio {_fmt_value(ratio)}" if ratio is not None else "", fontsize=9)
            ax.set_xlabel("num_tokens (rows per rank)")
            ax.grid(True, alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("fraction of roofline (roofline_us / p50)")
        axes.flat[0].legend(fontsize=7)
        _hide_unused(axes, len(ratios))
        title = _title(run, "Achieved fraction of the roofline", rs, dims, group)
        path = out / f"roof_fraction{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("roof_fraction", path, title, len(rs), group))
    return plots


def _stage_p50(stats: Any) -> float | None:
    if isinstance(stats, dict):
        v = stats.get("p50")
    else:
        v = stats
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _layer_stages(run: Run, out: Path) -> list[_Plot]:
    recs = [r for r in run.ok if isinstance(r.get("stages"), dict) and r["stages"]]
    if not recs:
        return []
    dims = ("padding_ratio", "mask", "impl")
    plots = []
    for group, rs in _split(recs, dims):
        stages: list[str] = []
        for r in rs:
            for s in r["stages"]:
                if s not in stages:
                    stages.append(s)
        stage_colors = dict(zip(stages, _colors(len(stages), "tab10")))
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        ratios = _sorted_unique(_param(r, "padding_ratio") for r in rs) or [None]
        masks = [m for m in (True, False, None) if any(_mask_of(r) is m for r in rs)]
        modes = {_mode_of(r) for r in rs}
        unmasked_word = " / ".join(w for m, w in (("unmasked", "unmasked"), ("oblivious", "mask-oblivious"))
                                   if m in modes)
        nrows, ncols = _grid(len(impls), 2)
        # bar slots per panel: an oblivious twin's panel has only unmasked bars, not an empty masked slot
        panel_masks = {impl: [m for m in masks if any(r["impl"] == impl and _mask_of(r) is m for r in rs)]
                       for impl in impls}
        slots = max(len(m) for m in panel_masks.values())
        fig, axes = _figure(nrows, ncols, panel_w=max(5.0, 1.2 * len(ratios) * slots), sharey=True)
        for ax, impl in zip(axes.flat, impls):
            width = 0.8 / len(panel_masks[impl])
            for xi, ratio in enumerate(ratios):
                for mi, mask in enumerate(panel_masks[impl]):
                    sub = [r for r in rs if r["impl"] == impl and _param(r, "padding_ratio") == ratio
                           and _mask_of(r) is mask]
                    if not sub:
                        continue
                    x = xi - 0.4 + width * (mi + 0.5)
                    bottom = 0.0
                    for s in stages:
                        v = _median([_stage_p50(r["stages"].get(s)) for r in sub])
                        if not v:
                            continue
                        ax.bar(x, v, width=width * 0.95, bottom=bottom, color=stage_colors[s],
                               hatch="//" if mask is False else None, edgecolor="white", lw=0.5)
                        bottom += v
                    whole = _median([_p(r) for r in sub])
                    if whole:
                        ax.plot([x - width * 0.45, x + width * 0.45], [whole, whole], color="black", lw=1.5)
            ax.set_xticks(range(len(ratios)))
            ax.set_xticklabels([_fmt_value(r) for r in ratios])
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
        if any(_p(r) for r in rs):
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], color="black", lw=1.5, label="whole layer p50"))
        axes.flat[0].legend(handles=handles, fontsize=7)
        _hide_unused(axes, len(impls))
        title = _title(run, "Layer latency per stage", rs, dims, group)
        path = out / f"layer_stages{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("layer_stages", path, title, len(rs), group))
    return plots


def _ep_scaling(run: Run, out: Path) -> list[_Plot]:
    recs = [r for r in run.ok if _p(r) is not None and isinstance(_param(r, "ep_size"), int)]
    if len({_param(r, "ep_size") for r in recs}) < 2:
        return []
    # ep_mode only says whether a size is simulated: drawn as hollow markers, not split into figures.
    dims = ("ep_size", "padding_ratio", "mask", "impl", "ep_mode", "num_local_experts")
    plots = []
    for group, rs in _split(recs, dims):
        if len({_param(r, "ep_size") for r in rs}) < 2:
            continue
        ratios = _sorted_unique(_param(r, "padding_ratio") for r in rs) or [None]
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        colors = dict(zip(impls, _colors(len(impls), "tab10")))
        styles = _mode_styles(rs)
        nrows, ncols = _grid(len(ratios))
        fig, axes = _figure(nrows, ncols, sharey=True)
        any_sim = False
        for ax, ratio in zip(axes.flat, ratios):
            sub = [r for r in rs if _param(r, "padding_ratio") == ratio]
            agg = _aggregate(sub, lambda r: (r["impl"], _mode_of(r), _param(r, "ep_size")))
            for impl in impls:
                for mode in _MODE_ORDER:
                    pts = sorted((k[2], v) for k, v in agg.items() if k[0] == impl and k[1] == mode)
                    if not pts:
                        continue
                    c = colors[impl]
                    ax.plot([x for x, _ in pts], [v["p50"] for _, v in pts], styles[mode], color=c,
                            label=_series_label(impl, mode))
                    for x, v in pts:
                        ax.plot([x], [v["p50"]], "o", ms=6, color=c,
                                markerfacecolor="none" if v["simulated"] else c)
                        if v["simulated"]:
                            any_sim = True
                            ax.annotate("simulated", (x, v["p50"]), textcoords="offset points", xytext=(4, 4),
                                        fontsize=6, color=c)
            ax.set_xscale("log", base=2)
            _log2_ticks(ax, [_param(r, "ep_size") for r in rs])
            ys = [_p(r) for r in rs]
            if max(ys) > 10 * min(ys):  # log only when the latencies span a decade; else plain numbers read better
                ax.set_yscale("log")
            ax.set_title(f"padding ratio {_fmt_value(ratio)}" if ratio is not None else "", fontsize=9)
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
        _hide_unused(axes, len(ratios))
        title = _title(run, "EP-size scaling", rs, dims, group)
        path = out / f"ep_scaling{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("ep_scaling", path, title, len(rs), group))
    return plots


def _trace_steps(r: dict) -> list[dict] | None:
    steps = (r.get("info") or {}).get("trace_steps")
    if isinstance(steps, list) and steps and all(isinstance(s, dict) for s in steps):
        return steps
    return None


def _compiles_counted(r: dict) -> bool:
    """False where the run could not count compiles (CPU / interpreter: "unsupported" or null per step): such a
    record has no compile curve to draw, and drawing its nulls as zeros would look like a perfect result."""
    if (r.get("info") or {}).get("observed_compiles") == "unsupported":
        return False
    return all(isinstance(s.get("compiles"), (int, float)) and not isinstance(s.get("compiles"), bool)
               for s in _trace_steps(r) or [])


def _cumulative(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def _jit_compiles(run: Run, out: Path) -> list[_Plot]:
    """`info.trace_steps[i]["compiles"]` / `["compile_s"]` are per step (this plot accumulates them);
    `info.predicted_compiles` is a total (horizontal line) or a per-step cumulative list."""
    recs = [r for r in run.ok if _trace_steps(r) and _param(r, "capacity_policy") is not None
            and _compiles_counted(r)]
    if not recs:
        return []
    dims = ("capacity_policy", "impl")
    plots = []
    for group, rs in _split(recs, dims):
        series = list(dict.fromkeys((r["impl"], _param(r, "capacity_policy")) for r in rs))
        multi_impl = len({s[0] for s in series}) > 1
        colors = dict(zip(series, _colors(len(series), "tab10")))
        has_seconds = any("compile_s" in s for r in rs for s in _trace_steps(r))
        nrows = 3 if has_seconds else 2
        fig, axes = _figure(nrows, 1, panel_w=8.0, panel_h=2.6, sharex=True)
        ax_c, ax_b = axes[0, 0], axes[-1, 0]
        ax_s = axes[1, 0] if has_seconds else None
        batch_drawn = False
        for key in series:
            r = next(x for x in rs if (x["impl"], _param(x, "capacity_policy")) == key)
            steps = _trace_steps(r)
            xs = [s.get("step", i) for i, s in enumerate(steps)]
            label = f"{key[0]} {key[1]}" if multi_impl else str(key[1])
            c = colors[key]
            ax_c.step(xs, _cumulative([float(s.get("compiles") or 0) for s in steps]), where="post", color=c,
                      label=label)
            pred = (r.get("info") or {}).get("predicted_compiles")
            if isinstance(pred, (int, float)):
                ax_c.axhline(pred, color=c, ls="--", lw=1, alpha=0.8)
            elif isinstance(pred, list) and len(pred) == len(xs):
                ax_c.step(xs, pred, where="post", color=c, ls="--", lw=1, alpha=0.8)
            if ax_s is not None:
                ax_s.step(xs, _cumulative([float(s.get("compile_s") or 0) for s in steps]), where="post",
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
        title = _title(run, "JIT compiles over a batch-size trace", rs, dims, group)
        path = out / f"jit_compiles{_slug(group)}.png"
        _save(fig, path, title)
        plots.append(_Plot("jit_compiles", path, title, len(rs), group))
    return plots


_MAKERS = (("latency_vs_tokens", _latency_vs_tokens), ("saving_vs_padding", _saving_vs_padding),
           ("expert_load", _expert_load), ("rank_load", _rank_load), ("roof_fraction", _roof_fraction),
           ("layer_stages", _layer_stages), ("ep_scaling", _ep_scaling), ("jit_compiles", _jit_compiles))


# ---------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------


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
    made: list[_Plot] = []
    for _, maker in _MAKERS:
        made += maker(run, out)
    meta = {"run": run.name, "run_dir": str(Path(run_dir).resolve()), "sweep": run.sweep_name,
            "gpu": _gpu_label(run.manifest),
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
        meta = {"run": run.name, "sweep": run.sweep_name, "gpu": _gpu_label(run.manifest), "records": {}}
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
