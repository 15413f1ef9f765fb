"""Run directories: manifest.json, records.jsonl (atomic appends, resumable, one record per point key) and
summary.csv (rewritten from the records)."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from moebench.measure.roofline import current_roofs
from moebench.records import MANIFEST, RECORDS, load_manifest, load_records  # noqa: F401 (re-exported)

SUMMARY = "summary.csv"


def utc_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


DEFAULT_RUNS_DIR = Path("results") / "runs"  # ignored by git; the committed references live in results/h200/


def new_run_dir(base: str | Path, sweep_name: str) -> Path:
    base = Path(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
        stamp = utc_stamp()
        run = base / f"{sweep_name}-{stamp}"
        n = 1
        while True:
            try:
                run.mkdir()  # exclusive: two runs started in the same second get -2, -3, ...
                return run
            except FileExistsError:
                n += 1
                run = base / f"{sweep_name}-{stamp}-{n}"
    except OSError as e:
        raise ValueError(f"--out {base}: cannot create the run directory ({e.strerror})") from None


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


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


def json_ready(record: dict) -> dict:
    """The record as it will be stored (tensors to lists, NaN to null): safe to pickle or compare."""
    return json.loads(json.dumps(_clean(record), default=_json_default, allow_nan=False))


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
        line = (json.dumps(_clean(record), default=_json_default, allow_nan=False) + "\n").encode()
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


def command_line() -> str:
    return " ".join([Path(sys.argv[0]).name] + sys.argv[1:])


def record_resume(run_dir: Path) -> dict:
    """Append this resume (command, time, host, pid) to the manifest's `resumes` list."""
    manifest = load_manifest(run_dir)
    manifest.setdefault("resumes", []).append(
        {"command": command_line(), "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "host": platform.node(), "pid": os.getpid()})
    write_json_atomic(Path(run_dir) / MANIFEST, manifest)
    return manifest


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict:
    """GPU name and count, driver, CUDA, torch, triton, deep_ep versions, host, CPU, OS and TRITON_INTERPRET
    (set: the Triton kernels ran in the interpreter, so their timings are no GPU figures)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                           "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cpu": cpu_model(), "cpu_count": os.cpu_count(), "os": platform.platform(),
                           "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import deep_ep  # noqa: F401

        env["deep_ep"] = getattr(deep_ep, "__version__", "present")
    except Exception as e:  # ImportError or a broken build
        env["deep_ep"] = None
        env["deep_ep_reason"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        env["gpu_count"] = n
        env["gpu"] = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["sm"] = f"{props.major}.{props.minor}"
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10)
                env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
            except (OSError, subprocess.SubprocessError, IndexError):
                env["driver"] = None
    else:
        env["gpu_count"] = 0
        env["gpu"] = None
    try:
        from moebench.measure.jit import triton_cache_dir

        env["triton_cache_dir"] = triton_cache_dir()
    except Exception:
        env["triton_cache_dir"] = None
    return env


def tuned_tables() -> dict:
    """The tuned launch tables the kernels read when a point names no config ({"sha256", "files"} of
    moebench/kernels/tuned/): recorded in the manifest, so that a resume under other tables is refused
    (moebench.run.resume) and a comparison of two runs can say their tables differ."""
    from moebench.kernels.runtime import tables_digest

    return tables_digest()


def write_manifest(run_dir: Path, sweep_dict: dict, num_points: int, device: str, extra: dict | None = None) -> dict:
    manifest = {
        "moebench": _version(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "git_commit": _git_commit(),
        "device": device,
        "env": environment(),
        "sweep": sweep_dict,
        "tuned_tables": tuned_tables(),
        "num_points": num_points,
        "roofs": current_roofs().as_dict(),
    }
    if extra:
        manifest.update(extra)
    write_json_atomic(Path(run_dir) / MANIFEST, manifest)
    return manifest


def _version() -> str:
    from moebench import __version__

    return __version__


def timing_label(rec: dict) -> str | None:
    """How a record was timed, for the table and summary: graph, events, wall, or interp (wall clock with the
    Triton kernels in the interpreter: a CPU figure, never to be read as a GPU one)."""
    mode = rec.get("timing_mode")
    if mode is None:
        return None
    if rec.get("triton_interpret"):
        return "interp"
    return "graph" if mode == "cuda_graph" else mode


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
