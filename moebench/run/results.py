"""Run directories: a new run's directory, the manifest's contents (environment, git commit, tuned tables, roofs)
and a resume's entry in it. The files' format (records.jsonl's atomic appends, manifest.json, summary.csv) is
moebench.records."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from moebench.measure.roofline import current_roofs
from moebench.records import MANIFEST, new_manifest, write_json_atomic
from moebench.records import load_manifest, load_records  # noqa: F401 (re-exported: the tests read runs so)


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


def record_machine_reference(run_dir: Path, when: str, reference: dict) -> None:
    """Keep a machine reference (moebench.measure.machine_reference) in the manifest: `start` of the run's first
    start (a resume's start goes into its `resumes` entry), `end` of its last end."""
    manifest = load_manifest(run_dir)
    refs = manifest.setdefault("machine_reference", {})
    if when == "start" and "start" in refs and manifest.get("resumes"):
        manifest["resumes"][-1]["machine_reference_start"] = reference
    else:
        refs[when] = reference
    write_json_atomic(Path(run_dir) / MANIFEST, manifest)


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
    manifest = new_manifest(
        version=_version(), created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=command_line(), git_commit=_git_commit(), device=device, env=environment(), sweep=sweep_dict,
        tuned_tables=tuned_tables(), num_points=num_points, roofs=current_roofs().as_dict(), extra=extra)
    write_json_atomic(Path(run_dir) / MANIFEST, manifest)
    return manifest


def _version() -> str:
    from moebench import __version__

    return __version__
