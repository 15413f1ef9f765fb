"""Reading a run for plotting and the record helpers every figure shares: parameter access, splitting a sweep
into figures, folding repeats, titles."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from moebench.presets import UnknownModel, get_preset
from moebench.records import RECORDS, load_manifest, load_records, timing_label

FOLDED = ("seed", "repeat")  # repeated measurements of one point: aggregated (median), never split on
MAX_FIGURES_PER_KIND = 24  # a sweep with many extra axes still gets a bounded number of files

# Parameters worth naming in a title when they are constant across the plotted points, with short labels.
TITLE_KEYS = (("num_experts", "E"), ("top_k", "top_k"), ("hidden", "H"), ("intermediate", "I"),
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
    records_path = run_dir / RECORDS
    if not records_path.exists():
        raise FileNotFoundError(f"{run_dir}: no {RECORDS} (not a run directory)")
    parsed = load_records(run_dir)
    # load_records skips lines that do not parse (a torn last line of an interrupted run); counted for plots.json
    lines = sum(1 for line in records_path.read_text().splitlines() if line.strip())
    records = [r for r in parsed if isinstance(r, dict)]
    return Run(run_dir, run_dir.resolve().name, load_manifest(run_dir), records, lines - len(parsed))


def default_plot_dir(run_dir: str | os.PathLike) -> Path:
    """plots/<run name>/: beside the results/ folder that holds the run, else under the current directory."""
    run_dir = Path(run_dir).resolve()
    base = run_dir.parent.parent if run_dir.parent.name == "results" else Path.cwd()
    return base / "plots" / run_dir.name


# ---------------------------------------------------------------------------------------------------------------
# Small helpers over records
# ---------------------------------------------------------------------------------------------------------------


def param(r: dict, key: str) -> Any:
    return (r.get("params") or {}).get(key)


def hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def varying(records: list[dict], exclude: Iterable[str] = ()) -> list[str]:
    """Parameter names (plus "impl") whose value differs between records, in params order."""
    skip = set(exclude) | set(FOLDED)
    keys: list[str] = []
    for r in records:
        for k in (r.get("params") or {}):
            if k not in keys:
                keys.append(k)
    out = [k for k in keys if k not in skip and len({hashable(param(r, k)) for r in records}) > 1]
    if "impl" not in skip and len({r.get("impl") for r in records}) > 1:
        out.append("impl")
    return out


def value_of(r: dict, key: str) -> Any:
    """A parameter of the record, or its impl name for the key "impl"."""
    return r.get("impl") if key == "impl" else param(r, key)


def split(records: list[dict], dims: Iterable[str]) -> list[tuple[dict, list[dict]]]:
    """Group records on every varying parameter that is not one of the plot's own `dims`."""
    extra = varying(records, exclude=dims)
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(hashable(value_of(r, k)) for k in extra), []).append(r)

    def order(item: tuple) -> tuple:
        return tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in item[0])

    out = [({k: value_of(rs[0], k) for k in extra}, rs) for _, rs in sorted(groups.items(), key=order)]
    return out[:MAX_FIGURES_PER_KIND]


def stat(r: dict, name: str = "p50") -> float | None:
    """One of the record's timing statistics (us), None unless finite and positive."""
    v = (r.get("stats") or {}).get(name)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def label_of(values: dict) -> str:
    short = dict(TITLE_KEYS)
    return ", ".join(f"{short.get(k) or k}={fmt_value(v)}" for k, v in values.items())


def slug(values: dict) -> str:
    """The file-name suffix of one figure of a split: its group's values."""
    if not values:
        return ""
    s = "__" + "_".join(f"{k}-{fmt_value(v)}" for k, v in values.items())
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", s)[:120]


def is_simulated(r: dict) -> bool:
    ranks = r.get("ranks")
    if isinstance(ranks, dict) and "simulated" in ranks:
        return bool(ranks["simulated"])
    return param(r, "ep_mode") == "simulated"


def sorted_unique(values: Iterable[Any]) -> list[Any]:
    vals = {v for v in values if v is not None}
    return sorted(vals, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))


def aggregate(records: list[dict], key: Callable[[dict], Any]) -> dict[Any, dict[str, float | None]]:
    """Median over records sharing `key` (repeats / seeds) of p50, p10, p90, roofline_us, roof_fraction."""
    buckets: dict[Any, list[dict]] = {}
    for r in records:
        buckets.setdefault(key(r), []).append(r)
    out = {}
    for k, rs in buckets.items():
        out[k] = {"p50": median([stat(r, "p50") for r in rs]), "p10": median([stat(r, "p10") for r in rs]),
                  "p90": median([stat(r, "p90") for r in rs]),
                  "roofline_us": median([r.get("roofline_us") for r in rs
                                         if isinstance(r.get("roofline_us"), (int, float))]),
                  "roof_fraction": median([r.get("roof_fraction") for r in rs
                                           if isinstance(r.get("roof_fraction"), (int, float))]),
                  "simulated": any(is_simulated(r) for r in rs), "n": len(rs)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Titles
# ---------------------------------------------------------------------------------------------------------------


def gpu_label(manifest: dict) -> str:
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


# The keys that choose a trace: a title names the trace the records ran (info.trace) instead of them, so that an
# explicit 3-step trace is never titled by the distribution and length the sweep fixed but did not use
TRACE_KEYS = ("trace", "trace_distribution", "trace_steps", "trace_max_tokens", "trace_file")


def trace_label(records: list[dict]) -> str | None:
    """`trace=chat (1000 steps)`, `trace=explicit (3 steps)`, `trace=file x.csv (..)` when every record ran the
    same trace, from the records' info.trace; None otherwise."""
    traces = {json.dumps((r.get("info") or {}).get("trace"), sort_keys=True, default=str) for r in records}
    if len(traces) != 1:
        return None
    trace = json.loads(traces.pop())
    if not isinstance(trace, dict) or not trace.get("source"):
        return None
    source = str(trace["source"])
    if source == "file" and trace.get("file"):
        source = f"file {os.path.basename(str(trace['file']))}"
    return f"trace={source}" + (f" ({trace['steps']} steps)" if trace.get("steps") else "")


def model_label(records: list[dict], model: str) -> tuple[str, set[str]]:
    """(`model=NAME`, or where the plotted points ran other values than the preset's (--size cpu, --set) the name
    with what overrode it, `model=deepseek-v3 (overridden: E=8, H=64)`; the keys it gave a value). A title never
    gives a preset's name to a layer of other dims. A key that varies over the points is named without a value
    (its axis shows it)."""
    try:
        preset = get_preset(model).values
    except UnknownModel:  # a record of a preset since renamed: its name is all there is
        return f"model={model}", set()
    short = dict(TITLE_KEYS)
    changed, shown = [], set()
    for key, value in preset.items():
        ran = {hashable(param(r, key)) for r in records if param(r, key) is not None}
        if ran and ran != {hashable(value)}:
            label = short.get(key) or key
            if len(ran) == 1:
                changed.append(f"{label}={fmt_value(param(records[0], key))}")
                shown.add(key)
            else:
                changed.append(label)
    return f"model={model}" + (f" (overridden: {', '.join(changed)})" if changed else ""), shown


def constant_params(records: list[dict], skip: Iterable[str], fixed_keys: Iterable[str] = ()) -> str:
    """The parameters that matter and are the same for every plotted point: those the sweep fixed (its `fixed`
    section), plus the expert count and top_k, in a stable order with short labels; the trace as it was run; a
    model preset the points overrode with what overrode it (model_label)."""
    skip = set(skip)
    trace = trace_label(records)
    if trace:
        skip |= set(TRACE_KEYS)
    short = dict(TITLE_KEYS)
    wanted = ["num_experts", "top_k"] + [k for k in fixed_keys if k not in ("num_experts", "top_k")]
    if not list(fixed_keys):  # no manifest: fall back to the usual suspects
        wanted += [k for k, _ in TITLE_KEYS if k not in wanted]
    order = ["model"] + [k for k, _ in TITLE_KEYS]  # the model first: it names the layer, or says what overrode it
    wanted.sort(key=lambda k: order.index(k) if k in order else len(order))
    parts = []
    models = {hashable(param(r, "model")) for r in records}
    if "model" in wanted and "model" not in skip and len(models) == 1 and param(records[0], "model") is not None:
        model, shown = model_label(records, str(param(records[0], "model")))
        parts.append(model)
        skip |= shown | {"model"}  # an overridden key is said once, beside the model
    for key in wanted:
        if key in skip or key in FOLDED:
            continue
        values = {hashable(param(r, key)) for r in records}
        if len(values) != 1:
            continue
        v = param(records[0], key)
        if v is None or (key == "padding_producer" and v == "ratio") or (key == "ep_size" and v == 1):
            continue
        if isinstance(v, list):
            v = ",".join(map(str, v[:6])) + (",..." if len(v) > 6 else "")
        label = short.get(key, key)
        parts.append(f"{label}={fmt_value(v)}" if label else fmt_value(v))
    if trace:
        parts.append(trace)
    timing = timing_subtitle(records)
    if timing:
        parts.append(timing)
    return ", ".join(parts)


def timing_subtitle(records: list[dict]) -> str:
    """`timing: graph` (the table's mode column: moebench.records.timing_label), and for a host-clock mode on
    the CPU (interp: the Triton kernels in the interpreter) that its figures are not GPU ones; empty when the
    points were timed in several modes."""
    modes = {timing_label(r) for r in records if timing_label(r)}
    if len(modes) != 1:
        return ""
    mode = modes.pop()
    on_cpu = not any(str(r.get("device") or "").startswith("cuda") for r in records)
    if mode == "interp":
        return "timing: interp (Triton interpreter on CPU, not GPU figures)"
    return f"timing: {mode}" + (" (CPU, not GPU figures)" if mode == "wall" and on_cpu else "")


def figure_title(run: Run, what: str, records: list[dict], dims: Iterable[str], group: dict) -> str:
    """Line 1: what, sweep and GPU; line 2: the figure's group values and the parameters constant in it."""
    line1 = f"{what} - sweep {run.sweep_name} on {gpu_label(run.manifest)}"
    fixed_keys = list(((run.manifest.get("sweep") or {}).get("fixed") or {}).keys())
    fixed = constant_params(records, set(dims) | set(group), fixed_keys)
    line2 = "; ".join(s for s in (label_of(group), fixed) if s)
    return line1 + ("\n" + line2 if line2 else "")
