"""The profiler driver behind `moebench profile`.

`profile_point` re-runs one sweep point under nsys when nsys and a GPU are present, else under torch.profiler, and
writes a per-range summary (count, CPU and device time, the kernels inside each range) as CSV plus a printed table.
`profile_inner` is the process nsys launches.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from moebench.measure.nvtx import EAGER_LAUNCHES
from moebench.profile.interpreted import KERNEL_RANGE_PREFIX, interpreted_kernel_ranges
from moebench.profile.nsys_reports import summarize_nsys_csv, summarize_nsys_traces
from moebench.profile.summary import (add_breakdown, format_summary, has_device_time, summarize_trace,
                                      write_summary_csv)

# ---------------------------------------------------------------------------------------------------------------
# Finding nsys
# ---------------------------------------------------------------------------------------------------------------

# Cheap, bounded places to look when nsys is not on PATH. On the H200 image nsys ships inside the Nsight Compute
# install, under a `target-linux-x64` folder.
NSYS_GLOBS = (
    "/opt/nvidia/**/target-linux-x64/nsys",
    "/opt/nvidia/nsight-systems*/*/bin/nsys",
    "/usr/local/cuda*/bin/nsys",
    "/usr/local/cuda*/nsight-compute*/**/target-linux-x64/nsys",
    "/usr/local/cuda*/nsight-systems*/bin/nsys",
)


def _is_exe(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


@lru_cache(maxsize=1)
def find_nsys() -> str | None:
    """Path of an executable nsys, or None. Order: $MOEBENCH_NSYS, PATH, then NSYS_GLOBS (newest first)."""
    env = os.environ.get("MOEBENCH_NSYS")
    if env and _is_exe(env):
        return os.path.abspath(env)
    on_path = shutil.which("nsys")
    if on_path and _is_exe(on_path):
        return os.path.abspath(on_path)
    for pattern in NSYS_GLOBS:
        # Reverse sort: versioned folders (2025.3.1 before 2024.6.0) put the newest install first.
        for hit in sorted(glob.glob(pattern, recursive=True), reverse=True):
            if _is_exe(hit):
                return os.path.abspath(hit)
    return None


# ---------------------------------------------------------------------------------------------------------------
# Driving one point
# ---------------------------------------------------------------------------------------------------------------


def _load_point(sweep_path: str | os.PathLike, point_index: int, overrides: list[str] | None):
    """(sweep, point) with the same validation as `moebench run`."""
    from moebench.run.sweep import expand, load_sweep

    sweep = load_sweep(sweep_path, overrides or [])
    points = expand(sweep)
    if not 0 <= point_index < len(points):
        raise ValueError(f"{sweep_path}: --point {point_index}: the sweep has {len(points)} points "
                         f"(0..{len(points) - 1})")
    return sweep, points[point_index]


def _run_point(sweep: Any, point_index: int, device: str, iters: int, hook: Callable[[str], None]) -> Any:
    from moebench.run.runner import run_single_point

    return run_single_point(sweep, point_index, device, iters, hook)


def _status_of(result: Any) -> str | None:
    return result.get("status") if isinstance(result, dict) else None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def nsys_profile_command(nsys: str, sweep_path: str | os.PathLike, point_index: int, out_dir: str | os.PathLike,
                         overrides: list[str] | None, device: str, iters: int) -> list[str]:
    """The nsys launch of the inner process; capture is limited to the profiled iterations (cudaProfilerApi)."""
    out_dir = Path(out_dir)
    cmd = [nsys, "profile", "-t", "cuda,nvtx", "-s", "none", "--cpuctxsw=none",
           "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--force-overwrite=true",
           "-o", str(out_dir / "profile"),
           sys.executable, "-m", "moebench", "profile", str(sweep_path), "--point", str(point_index), "--inner",
           "--device", device, "--iters", str(iters), "--out", str(out_dir)]
    for o in overrides or []:
        cmd += ["--set", o]
    return cmd


def nsys_stats_command(nsys: str, report_file: str | os.PathLike, reports: str, out_prefix: str | os.PathLike,
                       force_export: bool = False) -> list[str]:
    """`nsys stats` writing one `<out_prefix>_<report>.csv` per report (force_export: rebuild the .sqlite)."""
    return [nsys, "stats", "--report", reports, "--format", "csv", "--force-overwrite=true",
            f"--force-export={'true' if force_export else 'false'}", "-o", str(out_prefix), str(report_file)]


LIBS_ENV = "MOEBENCH_NSYS_LIBS"
LIBDW_HINT = (f"nsys needs libdw.so.1 (absent from some images, the H200's among them): set {LIBS_ENV} to a folder "
              "of the libdw1 and libelf1 .deb files (e.g. .carry/debs) or to a folder of their unpacked libraries")


def _lib_dirs_under(root: Path) -> list[str]:
    """Folders under `root` (itself included) that hold shared libraries, shallowest first."""
    dirs = {p.parent for p in root.rglob("lib*.so*") if p.is_file() or p.is_symlink()}
    return [str(d) for d in sorted(dirs, key=lambda d: (len(d.parts), str(d)))]


@lru_cache(maxsize=4)
def _unpack_debs(folder: str) -> str:
    """Unpack every .deb of `folder` (dpkg -x) into one temporary folder, once per process; returns it."""
    import tempfile

    dpkg = shutil.which("dpkg") or shutil.which("dpkg-deb")
    if dpkg is None:
        raise RuntimeError(f"{LIBS_ENV}={folder}: holds .deb files but neither dpkg nor dpkg-deb is installed "
                           "to unpack them (unpack them elsewhere and point it at the lib folder)")
    dest = tempfile.mkdtemp(prefix="moebench-nsys-libs-")
    for deb in sorted(Path(folder).glob("*.deb")):
        proc = subprocess.run([dpkg, "-x", str(deb), dest], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{LIBS_ENV}: dpkg -x {deb} failed: {_tail(proc.stderr, 300)}")
    return dest


def nsys_lib_dirs(spec: str | None = None) -> list[str]:
    """Library folders for nsys from $MOEBENCH_NSYS_LIBS (or `spec`): a folder of .deb files, unpacked once
    with dpkg -x, or an already unpacked folder; every folder under it holding lib*.so* files. [] when unset."""
    spec = spec if spec is not None else os.environ.get(LIBS_ENV, "")
    if not spec:
        return []
    root = Path(spec).expanduser()
    if not root.is_dir():
        raise RuntimeError(f"{LIBS_ENV}={spec}: no such folder")
    if any(root.glob("*.deb")):
        root = Path(_unpack_debs(str(root.resolve())))
    dirs = _lib_dirs_under(root)
    if not dirs:
        raise RuntimeError(f"{LIBS_ENV}={spec}: no .deb files and no lib*.so* libraries in it")
    return dirs


def _stats_env() -> dict[str, str]:
    # Turning the capture into a report (nsys's QDSTRM importer, run at the end of `nsys profile`) and `nsys
    # stats` both need libdw.so.1: the folders of MOEBENCH_NSYS_LIBS (and the older MOEBENCH_NSYS_LIBDIR, one
    # unpacked lib folder) go first on LD_LIBRARY_PATH for both steps, and only for them.
    env = dict(os.environ)
    extra = nsys_lib_dirs() + ([os.environ["MOEBENCH_NSYS_LIBDIR"]] if os.environ.get("MOEBENCH_NSYS_LIBDIR") else [])
    if extra:
        env["LD_LIBRARY_PATH"] = ":".join(extra + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    return env


def _with_libdw_hint(message: str) -> str:
    """The error of nsys lacking libdw, with what to do about it (unless MOEBENCH_NSYS_LIBS is already set)."""
    if os.environ.get(LIBS_ENV) or LIBS_ENV in message:
        return message
    return f"{message}\n{LIBDW_HINT}"


def _tail(text: str | bytes | None, n: int = 2000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def _profile_nsys(nsys: str, sweep_path, point_index: int, out_dir: Path, overrides, device: str, iters: int,
                  timeout_s: float) -> dict:
    result: dict[str, Any] = {"mode": "nsys", "nsys": nsys, "point": point_index, "out_dir": str(out_dir),
                              "files": [], "summary": [], "error": None}
    # Files of an earlier profile in this folder must not pass for this one's.
    for stale in [out_dir / "profile.nsys-rep", out_dir / "profile.sqlite", *out_dir.glob("profile_*.csv")]:
        if stale.exists():
            stale.unlink()
    cmd = nsys_profile_command(nsys, sweep_path, point_index, out_dir, overrides, device, iters)
    result["command"] = cmd
    env = _stats_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    log = out_dir / "profile_inner.log"
    log.write_text(f"$ {' '.join(cmd)}\n# rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    result["files"].append(str(log))
    rep = out_dir / "profile.nsys-rep"
    if proc.returncode != 0 or not rep.exists():
        text = f"nsys profile rc={proc.returncode}: {_tail(proc.stderr or proc.stdout)}"
        # no report after a clean exit is the importer failing, libdw's usual sign
        result["error"] = _with_libdw_hint(text) if "libdw" in text or proc.returncode == 0 else text
        return result
    result["files"].append(str(rep))

    stats = subprocess.run(nsys_stats_command(nsys, rep, "nvtx_sum,cuda_gpu_kern_sum", out_dir / "profile",
                                              force_export=True),
                           capture_output=True, text=True, timeout=timeout_s, env=env)
    csvs = sorted(out_dir.glob("profile_*.csv"))
    if stats.returncode != 0 or not csvs:
        # Typically libdw.so.1 missing: the .nsys-rep stays for a machine with a working nsys stats.
        text = f"nsys stats rc={stats.returncode}: {_tail(stats.stderr or stats.stdout)}"
        result["error"] = _with_libdw_hint(text) if "libdw" in text else text
        return result

    def pick(report: str) -> Path | None:
        hit = out_dir / f"profile_{report}.csv"
        return hit if hit.exists() else None

    # Kernels per range (device time per range) and the projected spans; without nvtx_kern_sum (an nsys without
    # it) the same attribution is joined from the three traces. Each is optional: a failure is only noted.
    notes = []

    def stats_report(report: str) -> None:
        p = subprocess.run(nsys_stats_command(nsys, rep, report, out_dir / "profile"),
                           capture_output=True, text=True, timeout=timeout_s, env=env)
        if p.returncode != 0 or not all(pick(r) for r in report.split(",")):
            notes.append(f"{report}: rc={p.returncode} {_tail(p.stderr or p.stdout, 300)}")

    for report in ("nvtx_kern_sum", "nvtx_gpu_proj_sum"):
        stats_report(report)
    traces = ("nvtx_pushpop_trace", "cuda_api_trace", "cuda_gpu_trace")
    if pick("nvtx_kern_sum") is None:
        stats_report(",".join(traces))
    if notes:
        result["notes"] = notes
    result["files"] += [str(c) for c in sorted(out_dir.glob("profile_*.csv"))]

    nvtx_csv = pick("nvtx_sum")
    if nvtx_csv is None:
        result["error"] = "nsys stats wrote no nvtx_sum CSV (no NVTX ranges were captured?)"
        return result
    if pick("nvtx_kern_sum") is None and all(pick(t) for t in traces):
        result["summary"] = summarize_nsys_traces(*(pick(t) for t in traces), pick("nvtx_gpu_proj_sum"))
    else:
        result["summary"] = summarize_nsys_csv(nvtx_csv, pick("nvtx_kern_sum"), pick("nvtx_gpu_proj_sum"))
    return result


def _profile_torch(sweep_path, point_index: int, out_dir: Path, overrides, device: str, iters: int) -> dict:
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    sweep, point = _load_point(sweep_path, point_index, overrides)
    activities = [ProfilerActivity.CPU]
    on_cuda = device.startswith("cuda") and torch.cuda.is_available()
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    state = {"started": False, "stopped": False, "kernel_ranges": False}
    # Only the profiled iterations run with their interpreted Triton launches in `triton/<kernel>` ranges: the
    # warm-up and the timed samples before them run exactly as in `moebench run`.
    kernel_ranges = contextlib.ExitStack()

    def hook(event: str) -> None:
        if on_cuda:
            torch.cuda.synchronize()  # warm-up work stays out of the trace; timed work is complete at stop
        if event == "start" and not state["started"]:
            state["kernel_ranges"] = kernel_ranges.enter_context(interpreted_kernel_ranges())
            prof.start()
            state["started"] = True
        elif event == "stop" and state["started"] and not state["stopped"]:
            prof.stop()
            kernel_ranges.close()
            state["stopped"] = True

    result: dict[str, Any] = {"mode": "torch.profiler", "point": point_index, "impl": point.impl,
                              "device": device, "out_dir": str(out_dir), "files": [], "summary": [], "error": None}
    try:
        point_result = _run_point(sweep, point_index, device, iters, hook)
    finally:
        if state["started"] and not state["stopped"]:
            prof.stop()  # the point raised mid-way: keep what was recorded
            state["stopped"] = True
        kernel_ranges.close()
    result["point_status"] = _status_of(point_result)
    if isinstance(point_result, dict):
        if point_result.get("profile"):
            result["profiled"] = point_result["profile"]
        if "triton_interpret" in point_result:
            result["triton_interpret"] = bool(point_result["triton_interpret"])
    result["interpreted_kernel_ranges"] = state["kernel_ranges"]
    if not state["started"]:
        reason = point_result.get("reason") if isinstance(point_result, dict) else None
        result["error"] = (f"the point never reached its profiled iterations (status {result['point_status']!r}"
                           + (f": {reason}" if reason else "") + "): nothing was profiled")
        return result
    trace_path = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    result["files"].append(str(trace_path))
    result["summary"] = summarize_trace(trace_path)
    return result


def summary_header(result: dict) -> str:
    """What the figures of this profile are. With device time: e.g. "device time from eager launches, 20 profiled
    iterations (nsys nvtx_kern_sum)". Without (a CPU profile): the ranges' wall time and share of the point's,
    and on a second line that the times are the CPU's, under Triton's interpreter when it ran the kernels: never
    GPU figures."""
    summary = result.get("summary") or []
    launch, iters = result.get("launch", EAGER_LAUNCHES), result.get("iterations", "?")
    if has_device_time(summary):
        sources = sorted({s["device_source"] for s in summary if s.get("device_source")})
        return f"device time from {launch}, {iters} profiled iterations ({result['mode']} " + "/".join(sources) + ")"
    if not str(result.get("device", "")).startswith("cpu"):  # a GPU profile that recorded no device work
        return f"host time of each range from {launch}, {iters} profiled iterations ({result['mode']}, no device time)"
    head = (f"wall time of each range on the host, {iters} profiled iterations ({launch} after the point's warm-up "
            f"and timing; {result['mode']}); share: of the point's wall time")
    launches = any(k["name"].startswith(KERNEL_RANGE_PREFIX) for s in summary for k in s.get("kernels") or [])
    if result.get("triton_interpret") and (launches or not result.get("interpreted_kernel_ranges")):
        how = "Triton's interpreter ran the kernels (TRITON_INTERPRET=1): interpreter times on the CPU, not GPU figures"
        if launches:
            how += f"; {KERNEL_RANGE_PREFIX}<kernel>: that kernel's launches"
        return f"{head}\n{how}"
    return f"{head}\nmeasured on the CPU: not GPU figures"


def profile_point(sweep_path: str | os.PathLike, point_index: int, out_dir: str | os.PathLike,
                  overrides: list[str] | None = None, device: str | None = None, *, iters: int = 20,
                  use_nsys: bool | None = None, timeout_s: float = 1800.0, echo: bool = True) -> dict:
    """Profile one point of a sweep; returns what was done (mode, files, per-range summary, error or None).

    What is captured: `iters` eager iterations run after the point's timing (execute_point's profile_iters),
    one NVTX range per call and one per pipeline stage nested under it, so each range's device time is the
    kernels launched inside it. nsys (found by find_nsys) and CUDA: the point is re-launched as `python -m
    moebench profile ... --inner` under `nsys profile` with capture limited to those iterations, then `nsys
    stats` CSVs are written next to the .nsys-rep (libraries nsys lacks: $MOEBENCH_NSYS_LIBS, nsys_lib_dirs).
    Otherwise torch.profiler records the same iterations in this process and a chrome trace (trace.json) is
    exported; on a CPU each launch of a kernel in Triton's interpreter is a `triton/<kernel>` range there
    (moebench.profile.interpreted) and the ranges' wall time is the figure (summary_header). torch.profiler is
    used too when nsys writes no report at all (its importer failing without libdw, say), with `nsys_error` and
    a `note` saying so. Either way the per-range summary goes to
    profile_summary.csv, is printed when `echo`, and the returned dict is saved as profile.json.
    `use_nsys=False` forces torch.profiler.
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = device or _default_device()
    nsys = find_nsys() if use_nsys is not False else None
    if use_nsys and nsys is None:
        raise RuntimeError("nsys requested but not found (PATH, $MOEBENCH_NSYS, " + ", ".join(NSYS_GLOBS) + ")")
    if nsys and device.startswith("cuda") and torch.cuda.is_available():
        _load_point(sweep_path, point_index, overrides)  # fail fast on a bad sweep or index, before nsys starts
        result = _profile_nsys(nsys, sweep_path, point_index, out_dir, overrides, device, iters, timeout_s)
        if not (out_dir / "profile.nsys-rep").exists():
            # nsys ran but wrote no report (its importer needs libdw.so.1): the point is still profiled,
            # with torch.profiler, and the result says why
            why = result["error"] or "nsys wrote no report"
            inner_log = result["files"]
            result = _profile_torch(sweep_path, point_index, out_dir, overrides, device, iters)
            result["files"] += inner_log
            result["nsys_error"] = why
            result["note"] = f"nsys wrote no report, torch.profiler used instead: {why.splitlines()[0][:200]}"
    else:
        result = _profile_torch(sweep_path, point_index, out_dir, overrides, device, iters)
    # The profiled iterations are eager launches by construction (moebench.measure.nvtx.profiled_iterations).
    result["launch"] = (result.get("profiled") or {}).get("launch", EAGER_LAUNCHES)
    result["iterations"] = iters
    result["header"] = summary_header(result)
    if result["summary"]:
        result["summary"] = add_breakdown(result["summary"])
        csv_path = write_summary_csv(result["summary"], out_dir / "profile_summary.csv", launch=result["launch"])
        result["files"].append(str(csv_path))
    (out_dir / "profile.json").write_text(json.dumps(result, indent=2, default=str))
    if echo:
        print(f"# profile ({result['mode']}) of point {point_index} -> {out_dir}")
        print(format_summary(result["summary"], header=result["header"]))
        if result.get("note"):
            print(f"# note: {result['note']}")
        if result["error"]:
            print(f"# error: {result['error']}")
    return result


def profile_inner(sweep_path: str | os.PathLike, point_index: int, overrides: list[str] | None = None,
                  device: str = "cuda", iters: int = 20) -> Any:
    """The process nsys launches (`moebench profile ... --inner`): runs the point with the CUDA profiler API
    switched on only around the profiled iterations, which is what `--capture-range=cudaProfilerApi` records."""
    import torch

    sweep, _ = _load_point(sweep_path, point_index, overrides)

    def hook(event: str) -> None:
        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        if event == "start":
            torch.cuda.profiler.start()
        elif event == "stop":
            torch.cuda.profiler.stop()

    return _run_point(sweep, point_index, device, iters, hook)
