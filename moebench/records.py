"""A run directory's format, read and written: records.jsonl (one JSON line per point), manifest.json and
summary.csv. It sits at the bottom of the package (it imports nothing of moebench), so that everything which reads
or writes a run (the runner in moebench.run, the reports, the plots, the wire model's calibration in
moebench.dispatch) shares one format without importing the runner. What goes into a manifest (the environment,
the roofs, the tuned tables) is gathered by moebench.run.results, which writes it through `new_manifest`.

A record (moebench.run.point writes it) holds: point, key, impl (kernel, variant, target, mask_aware, twin_of,
library, ceiling), params, status (ok | wrong | failed | skipped) and reason, device, triton_interpret; once built
and checked: check {ok, detail, metrics}; once timed: timing_mode, timing_unroll, timing_note, samples_us, stats
{p50, p10, p90, min, max, mean, cv, n}, stages {name: stats and mode}, ranks (multi-rank), gpu_state (CUDA),
profile (`moebench profile`); bytes, flops, bytes_note, gbps, tflops, roofline_us, roof_fraction; info (the impl's
own); imbalance; jit; wall_s; traceback and the *_error fields when something failed; isolation and
worker_restarted (the point worker)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Iterable

# the two sides of every mask-aware figure: padded rows masked (routed nowhere) and routed like real rows
SIDES = ("masked", "oblivious")

RECORDS = "records.jsonl"
MANIFEST = "manifest.json"
SUMMARY = "summary.csv"


# ---------------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------------

def load_records(run_dir: str | Path) -> list[dict]:
    """Every record of the run, in file order; a torn last line (a killed run) is skipped."""
    path = Path(run_dir) / RECORDS
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from a killed run
    return out


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: store them as null so every line parses with any reader."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def record_line(record: dict) -> str:
    """The record as one line of records.jsonl (tensors to lists, NaN and inf to null), newline included."""
    return json.dumps(_clean(record), default=_json_default, allow_nan=False) + "\n"


def json_ready(record: dict) -> dict:
    """The record as it will be stored (tensors to lists, NaN to null): safe to pickle or compare."""
    return json.loads(record_line(record))


class RecordWriter:
    """Appends one JSON line per point with a single O_APPEND write + fsync, so a killed run leaves at most one
    torn trailing line, which `load_records` ignores and `--resume` redoes."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RECORDS
        self._repair()

    def _repair(self) -> None:
        # Drop a torn last line (no newline) left by a killed run, so the next append starts a fresh line.
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(cut)

    def append(self, record: dict) -> None:
        line = record_line(record).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def unique_records(records: Iterable[dict]) -> list[dict]:
    """The first record of each point key (records without a key are kept): what the summary and footer count."""
    seen: set = set()
    out = []
    for r in records:
        key = r.get("key")
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out.append(r)
    return out


def timing_label(rec: dict) -> str | None:
    """How a record was timed, for the table and summary: graph, events, wall, or interp (wall clock with the
    Triton kernels in the interpreter: a CPU figure, never to be read as a GPU one). interp only where the timed
    region launched an interpreted kernel (`interpreted_launches`; a record from before it was counted: interp
    whenever the interpreter was on): a pure-torch or plugin row timed under the interpreter is `wall`."""
    mode = rec.get("timing_mode")
    if mode is None:
        return None
    if rec.get("triton_interpret") and rec.get("interpreted_launches", 1) > 0:
        return "interp"
    return "graph" if mode == "cuda_graph" else mode


# ---------------------------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------------------------

def load_manifest(run_dir: str | Path) -> dict:
    """The run's manifest.json, {} when there is none."""
    path = Path(run_dir) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def new_manifest(*, version: str, created_utc: str, command: str, git_commit: str | None, device: str, env: dict,
                 sweep: dict, tuned_tables: dict, num_points: int, roofs: dict, extra: dict | None = None) -> dict:
    """A new run's manifest: the moebench version, when and how it was started (`command`, the checkout's
    `git_commit`), the `device` and its `env` (moebench.run.results.environment), the expanded `sweep`, the
    `tuned_tables` digest, `num_points` and the `roofs` its fractions are of; `extra` keys after them (a torchrun
    world size). A resume appends to its `resumes` list; `scripts/slim_run.py` sets `slimmed`."""
    manifest = {"moebench": version, "created_utc": created_utc, "command": command, "git_commit": git_commit,
                "device": device, "env": env, "sweep": sweep, "tuned_tables": tuned_tables, "num_points": num_points,
                "roofs": roofs}
    manifest.update(extra or {})
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# summary.csv
# ---------------------------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("point", "impl", "status", "timing_mode", "mode", "p50_us", "p10_us", "p90_us", "min_us",
                   "max_us", "mean_us", "cv", "n", "bytes", "gbps", "tflops", "roofline_us", "roof_fraction",
                   "jit_compiles", "jit_compile_s", "expert_max_over_mean", "rank_max_over_mean", "slowest_rank",
                   "reason")


def summary_rows(records: Iterable[dict], param_names: list[str]) -> list[dict]:
    rows = []
    for r in records:
        st = r.get("stats") or {}
        imb = r.get("imbalance") or {}
        jit = r.get("jit") or {}
        row = {"point": r.get("point"), "impl": r.get("impl"), "status": r.get("status"),
               "timing_mode": r.get("timing_mode"), "mode": timing_label(r), "p50_us": st.get("p50"),
               "p10_us": st.get("p10"), "p90_us": st.get("p90"), "min_us": st.get("min"), "max_us": st.get("max"),
               "mean_us": st.get("mean"),
               "cv": st.get("cv"), "n": st.get("n"), "bytes": r.get("bytes"), "gbps": r.get("gbps"),
               "tflops": r.get("tflops"), "roofline_us": r.get("roofline_us"),
               "roof_fraction": r.get("roof_fraction"), "jit_compiles": jit.get("compiles"),
               "jit_compile_s": jit.get("compile_s"),
               "expert_max_over_mean": (imb.get("expert") or {}).get("max_over_mean"),
               "rank_max_over_mean": (imb.get("rank") or {}).get("max_over_mean"),
               "slowest_rank": (r.get("ranks") or {}).get("slowest_rank", (imb.get("rank") or {}).get("slowest_rank")),
               "reason": r.get("reason", "")}
        params = r.get("params") or {}
        for k in param_names:
            v = params.get(k)
            row[k] = json.dumps(v) if isinstance(v, list) else v
        for name, stage in (r.get("stages") or {}).items():
            row[f"stage_{name}_p50_us"] = (stage or {}).get("p50")
        rows.append(row)
    return rows


def write_summary(run_dir: Path, records: list[dict], param_names: list[str]) -> Path:
    rows = summary_rows(records, param_names)
    cols = list(SUMMARY_COLUMNS[:2]) + list(param_names) + list(SUMMARY_COLUMNS[2:])
    for row in rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    path = Path(run_dir) / SUMMARY
    tmp = path.with_name(SUMMARY + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for row in rows:
            w.writerow(row)
    os.replace(tmp, path)
    return path
