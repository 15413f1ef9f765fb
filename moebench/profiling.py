"""NVTX ranges and the profiler drivers behind `moebench profile`.

Every timed piece runs inside `nvtx_range(range_name(stage, impl))`, i.e. a range named `moebench/<stage>/<impl>`,
so an nsys timeline reads like the MoE pipeline. `profile_point` re-runs one sweep point under nsys when nsys and a
GPU are present, else under torch.profiler, and writes a per-range summary (count, CPU and device time, the kernels
inside each range) as CSV plus a printed table.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

RANGE_PREFIX = "moebench/"

# ---------------------------------------------------------------------------------------------------------------
# NVTX ranges
# ---------------------------------------------------------------------------------------------------------------


def range_name(stage: str, impl: str) -> str:
    """`moebench/<stage>/<impl>`; an empty stage defaults to the impl's kernel name (as Case.nvtx_stage does)."""
    if not impl:
        raise ValueError("range_name: impl must be a non-empty name")
    return f"{RANGE_PREFIX}{stage or impl.split('.', 1)[0]}/{impl}"


def _noop(*_args: Any) -> None:
    return None


def _select_backend(prefer: str | None = None) -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    """(backend name, push(name), pop()): the `nvtx` package, else torch.cuda.nvtx on CUDA, else no-op.

    `prefer` forces one of "nvtx", "torch", "none" (tests); an unusable choice falls through to the next one.
    """
    order = ("nvtx", "torch", "none")
    start = order.index(prefer) if prefer in order else 0
    for choice in order[start:]:
        if choice == "nvtx":
            try:
                import nvtx  # type: ignore[import-not-found]

                return "nvtx", (lambda name: nvtx.push_range(message=name)), nvtx.pop_range
            except Exception:  # not installed, or its native library failed to load
                continue
        if choice == "torch":
            try:
                import torch

                if torch.cuda.is_available():
                    return "torch.cuda.nvtx", torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
            except Exception:
                continue
    return "none", _noop, _noop


@lru_cache(maxsize=1)
def _backend() -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    return _select_backend()


def nvtx_backend() -> str:
    """Which NVTX backend nvtx_range uses here: "nvtx", "torch.cuda.nvtx" or "none"."""
    return _backend()[0]


@lru_cache(maxsize=1)
def _profiler_flag() -> Callable[[], bool]:
    """The cheapest available 'is a torch.profiler session recording?' check, resolved once."""
    try:
        import torch

        flag = torch._C._autograd._profiler_enabled
        flag()
        return flag
    except Exception:  # pragma: no cover - private API moved, or no torch
        try:
            import torch.autograd.profiler as ap

            return lambda: bool(getattr(ap, "_is_profiler_enabled", False))
        except Exception:
            return lambda: False


def _torch_profiler_enabled() -> bool:
    return bool(_profiler_flag()())


class nvtx_range:
    """Context manager: an NVTX push/pop range around the block.

    While a torch.profiler session is recording it also opens a `record_function` of the same name, so the
    torch.profiler fallback sees the same `moebench/...` ranges that nsys would. Outside a profiler session that
    costs nothing but one flag read (the timed loops stay lean).
    """

    __slots__ = ("name", "_pop", "_record")

    def __init__(self, name: str):
        self.name = name
        self._pop: Callable[[], Any] = _noop
        self._record: Any = None

    def __enter__(self) -> "nvtx_range":
        _, push, pop = _backend()
        push(self.name)
        self._pop = pop
        if _torch_profiler_enabled():
            from torch.autograd.profiler import record_function

            self._record = record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._record is not None:
                self._record.__exit__(exc_type, exc, tb)
                self._record = None
        finally:
            self._pop()


# ---------------------------------------------------------------------------------------------------------------
# Finding nsys
# ---------------------------------------------------------------------------------------------------------------

# Cheap, bounded places to look when nsys is not on PATH. On the H200 image nsys ships inside the Nsight Compute
# install (GPU.md), under a `target-linux-x64` folder.
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
# torch.profiler trace -> per-range summary
# ---------------------------------------------------------------------------------------------------------------

_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _complete_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _top_level_ops(ops: list[dict]) -> list[dict]:
    """Ops of one thread not nested inside another op of the list (aten::matmul, not the aten::mm inside it)."""
    out: list[dict] = []
    end = float("-inf")
    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if op["ts"] >= end:
            out.append(op)
            end = op["ts"] + op["dur"]
    return out


def summarize_trace(trace: str | os.PathLike | dict, prefix: str = RANGE_PREFIX) -> list[dict]:
    """Per-range summary of a torch.profiler chrome trace (a path or the loaded JSON).

    For each range whose name starts with `prefix` (record_function / NVTX ranges, category `user_annotation`):
    count, CPU total and mean (us), device total and mean (us) from the GPU-side projection of the range
    (`gpu_user_annotation`) or else the summed kernel time, and the work inside it: GPU kernels (matched to the
    range through the launching runtime call's correlation id) when the trace has any, else the top-level CPU
    ops. Ranges are listed in order of first appearance; kernels by total time, largest first.
    """
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    events = _complete_events(trace)
    ranges = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)]
    gpu_ranges = [e for e in events
                  if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith(prefix)]
    launches = [e for e in events if e.get("cat") in _LAUNCH_CATS]
    device_by_corr: dict[Any, list[dict]] = {}
    for e in events:
        if e.get("cat") in _DEVICE_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                device_by_corr.setdefault(corr, []).append(e)
    have_device = bool(device_by_corr)
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]

    order: list[str] = []
    by_name: dict[str, list[dict]] = {}
    for r in sorted(ranges, key=lambda e: e["ts"]):
        if r["name"] not in by_name:
            order.append(r["name"])
        by_name.setdefault(r["name"], []).append(r)

    def inside(e: dict, r: dict) -> bool:
        return (e.get("pid") == r.get("pid") and e.get("tid") == r.get("tid")
                and r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3)

    summary: list[dict] = []
    for name in order:
        inst = by_name[name]
        cpu_total = sum(r["dur"] for r in inst)
        work: dict[str, list[float]] = {}
        if have_device:
            kind = "gpu_kernel"
            for r in inst:
                for launch in launches:
                    if inside(launch, r):
                        corr = (launch.get("args") or {}).get("correlation")
                        for k in device_by_corr.get(corr, []):
                            work.setdefault(k["name"], []).append(k["dur"])
        else:
            kind = "cpu_op"
            for r in inst:
                for op in _top_level_ops([o for o in cpu_ops if inside(o, r)]):
                    work.setdefault(op["name"], []).append(op["dur"])
        gpu_inst = [g for g in gpu_ranges if g["name"] == name]
        if gpu_inst:
            device_total: float | None = sum(g["dur"] for g in gpu_inst)
            device_source = "gpu_user_annotation"
        elif have_device:
            device_total = sum(sum(v) for v in work.values())
            device_source = "kernels"
        else:
            device_total, device_source = None, ""
        kernels = sorted(({"name": k, "count": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v)}
                          for k, v in work.items()), key=lambda k: -k["total_us"])
        summary.append({
            "range": name, "count": len(inst),
            "cpu_total_us": cpu_total, "cpu_mean_us": cpu_total / len(inst),
            "device_total_us": device_total,
            "device_mean_us": None if device_total is None else device_total / len(inst),
            "device_source": device_source, "kernel_kind": kind, "kernels": kernels,
        })
    return summary


_CSV_COLUMNS = ("range", "count", "cpu_total_us", "cpu_mean_us", "device_total_us", "device_mean_us",
                "device_source", "kernel_kind", "kernel", "kernel_count", "kernel_total_us", "kernel_mean_us")


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def write_summary_csv(summary: list[dict], path: str | os.PathLike) -> Path:
    """One row per (range, kernel); a range without kernels gets one row with empty kernel columns."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_CSV_COLUMNS)
        for s in summary:
            head = [s["range"], s["count"], s["cpu_total_us"], s["cpu_mean_us"], s["device_total_us"],
                    s["device_mean_us"], s["device_source"], s["kernel_kind"]]
            rows = [[k["name"], k["count"], k["total_us"], k["mean_us"]] for k in s["kernels"]] or [[None] * 4]
            for row in rows:
                w.writerow([_fmt(v) for v in head + row])
    return path


def format_summary(summary: list[dict], max_kernels: int = 8) -> str:
    """The printed table: one line per range, its kernels (or CPU ops) indented below."""
    if not summary:
        return f"# no {RANGE_PREFIX}... ranges in the profile"
    width = max(40, max(len(s["range"]) for s in summary) + 2)
    lines = [f"{'range':<{width}}{'count':>7}{'cpu total':>12}{'cpu mean':>11}{'dev total':>12}{'dev mean':>11}",
             f"{'':<{width}}{'':>7}{'(us)':>12}{'(us)':>11}{'(us)':>12}{'(us)':>11}"]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for s in summary:
        lines.append(f"{s['range']:<{width}}{s['count']:>7}{num(s['cpu_total_us']):>12}{num(s['cpu_mean_us']):>11}"
                     f"{num(s['device_total_us']):>12}{num(s['device_mean_us']):>11}")
        for k in s["kernels"][:max_kernels]:
            name = k["name"] if len(k["name"]) <= width - 4 else k["name"][: width - 7] + "..."
            lines.append(f"    {name:<{width - 4}}{k['count']:>7}{num(k['total_us']):>12}{num(k['mean_us']):>11}")
        if len(s["kernels"]) > max_kernels:
            lines.append(f"    ... {len(s['kernels']) - max_kernels} more {s['kernel_kind']}s in the CSV")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# nsys stats CSV -> the same summary shape
# ---------------------------------------------------------------------------------------------------------------


def _read_csv(path: str | os.PathLike) -> list[dict]:
    text = Path(path).read_text()
    # nsys may print a banner line before the header; the header is the first line holding a quoted or comma list.
    lines = text.splitlines()
    while lines and "," not in lines[0]:
        lines.pop(0)
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def _col(row: dict, *names: str) -> Any:
    """First column whose header equals (case-insensitively) one of `names`."""
    low = {k.strip().lower(): v for k, v in row.items() if k is not None}
    for n in names:
        if n.lower() in low:
            return low[n.lower()]
    return None


def _ns_to_us(v: Any) -> float | None:
    try:
        return float(str(v).replace(",", "")) / 1000.0
    except (TypeError, ValueError):
        return None


def _int(v: Any) -> int:
    try:
        return int(float(str(v).replace(",", "")))
    except (TypeError, ValueError):
        return 0


def _clean_range(name: Any) -> str:
    # nsys shows push/pop ranges of the default domain as ":name" (and "domain:name" otherwise).
    s = str(name or "").strip()
    i = s.find(RANGE_PREFIX)
    return s[i:] if i >= 0 else s


def summarize_nsys_csv(nvtx_sum: str | os.PathLike, nvtx_kern_sum: str | os.PathLike | None = None,
                       nvtx_gpu_proj_sum: str | os.PathLike | None = None) -> list[dict]:
    """Per-range summary from `nsys stats` CSVs: nvtx_sum (count, CPU-side range time), optionally
    nvtx_kern_sum (kernels inside each range) and nvtx_gpu_proj_sum (device-side time of each range)."""
    summary: dict[str, dict] = {}
    for row in _read_csv(nvtx_sum):
        name = _clean_range(_col(row, "Range", "Name"))
        if not name.startswith(RANGE_PREFIX):
            continue
        count = _int(_col(row, "Instances", "Num Calls", "Count"))
        total = _ns_to_us(_col(row, "Total Time (ns)", "Total Time"))
        summary[name] = {"range": name, "count": count, "cpu_total_us": total,
                         "cpu_mean_us": _ns_to_us(_col(row, "Avg (ns)", "Average (ns)", "Avg")),
                         "device_total_us": None, "device_mean_us": None, "device_source": "",
                         "kernel_kind": "gpu_kernel", "kernels": []}
    if nvtx_gpu_proj_sum and Path(nvtx_gpu_proj_sum).exists():
        for row in _read_csv(nvtx_gpu_proj_sum):
            s = summary.get(_clean_range(_col(row, "Range", "Name")))
            if s is None:
                continue
            total = _ns_to_us(_col(row, "Total Proj Time (ns)", "Total GPU Time (ns)", "Total Time (ns)"))
            if total is not None:
                s["device_total_us"] = total
                s["device_mean_us"] = total / s["count"] if s["count"] else None
                s["device_source"] = "nvtx_gpu_proj_sum"
    if nvtx_kern_sum and Path(nvtx_kern_sum).exists():
        for row in _read_csv(nvtx_kern_sum):
            s = summary.get(_clean_range(_col(row, "NVTX Range", "Range")))
            if s is None:
                continue
            total = _ns_to_us(_col(row, "Total Time (ns)", "Total Time")) or 0.0
            count = _int(_col(row, "Kern Inst", "Kernel Instances", "Instances"))
            s["kernels"].append({"name": str(_col(row, "Kernel Name", "Name") or "?"), "count": count,
                                 "total_us": total, "mean_us": total / count if count else 0.0})
        for s in summary.values():
            s["kernels"].sort(key=lambda k: -k["total_us"])
            if s["device_total_us"] is None and s["kernels"]:
                s["device_total_us"] = sum(k["total_us"] for k in s["kernels"])
                s["device_mean_us"] = s["device_total_us"] / s["count"] if s["count"] else None
                s["device_source"] = "kernels"
    return list(summary.values())


# ---------------------------------------------------------------------------------------------------------------
# Driving one point
# ---------------------------------------------------------------------------------------------------------------


def _load_point(sweep_path: str | os.PathLike, point_index: int, overrides: list[str] | None):
    """(sweep, point) with the same validation as `moebench run`."""
    from moebench.sweep import expand, load_sweep

    sweep = load_sweep(sweep_path, overrides or [])
    points = expand(sweep)
    if not 0 <= point_index < len(points):
        raise ValueError(f"{sweep_path}: --point {point_index}: the sweep has {len(points)} points "
                         f"(0..{len(points) - 1})")
    return sweep, points[point_index]


def _run_point(sweep: Any, point_index: int, device: str, iters: int, hook: Callable[[str], None]) -> Any:
    from moebench.runner import run_single_point

    return run_single_point(sweep, point_index, device, iters, hook)


def _status_of(result: Any) -> str | None:
    return result.get("status") if isinstance(result, dict) else None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def nsys_profile_command(nsys: str, sweep_path: str | os.PathLike, point_index: int, out_dir: str | os.PathLike,
                         overrides: list[str] | None, device: str, iters: int) -> list[str]:
    """The nsys launch of the inner process; capture is limited to the timed iterations (cudaProfilerApi)."""
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


def _stats_env() -> dict[str, str]:
    # Turning the capture into a report (nsys's QDSTRM importer, run at the end of `nsys profile`) and `nsys
    # stats` both need libdw.so.1, absent from the H200 image (GPU.md): MOEBENCH_NSYS_LIBDIR may point at an
    # unpacked libdw1/libelf1 (usr/lib/x86_64-linux-gnu); it is added to LD_LIBRARY_PATH for both steps.
    env = dict(os.environ)
    extra = os.environ.get("MOEBENCH_NSYS_LIBDIR")
    if extra:
        env["LD_LIBRARY_PATH"] = extra + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_stats_env())
    log = out_dir / "profile_inner.log"
    log.write_text(f"$ {' '.join(cmd)}\n# rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    result["files"].append(str(log))
    rep = out_dir / "profile.nsys-rep"
    if proc.returncode != 0 or not rep.exists():
        result["error"] = f"nsys profile rc={proc.returncode}: {_tail(proc.stderr or proc.stdout)}"
        return result
    result["files"].append(str(rep))

    stats = subprocess.run(nsys_stats_command(nsys, rep, "nvtx_sum,cuda_gpu_kern_sum", out_dir / "profile",
                                              force_export=True),
                           capture_output=True, text=True, timeout=timeout_s, env=_stats_env())
    csvs = sorted(out_dir.glob("profile_*.csv"))
    if stats.returncode != 0 or not csvs:
        # Typically libdw.so.1 missing: the .nsys-rep stays for a machine with a working nsys stats.
        result["error"] = f"nsys stats rc={stats.returncode}: {_tail(stats.stderr or stats.stdout)}"
        return result
    # Extra reports for kernels-per-range and device time per range; optional, their failure is only noted.
    notes = []
    for extra in ("nvtx_kern_sum", "nvtx_gpu_proj_sum"):
        p = subprocess.run(nsys_stats_command(nsys, rep, extra, out_dir / "profile"),
                           capture_output=True, text=True, timeout=timeout_s, env=_stats_env())
        if p.returncode != 0:
            notes.append(f"{extra}: rc={p.returncode} {_tail(p.stderr, 300)}")
    if notes:
        result["notes"] = notes
    csvs = sorted(out_dir.glob("profile_*.csv"))
    result["files"] += [str(c) for c in csvs]

    def pick(report: str) -> Path | None:
        hits = [c for c in csvs if c.stem.endswith("_" + report)]
        return hits[0] if hits else None

    nvtx_csv = pick("nvtx_sum")
    if nvtx_csv is None:
        result["error"] = "nsys stats wrote no nvtx_sum CSV (no NVTX ranges were captured?)"
        return result
    result["summary"] = summarize_nsys_csv(nvtx_csv, pick("nvtx_kern_sum"), pick("nvtx_gpu_proj_sum"))
    return result


def _profile_torch(sweep_path, point_index: int, out_dir: Path, overrides, device: str, iters: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sweep, point = _load_point(sweep_path, point_index, overrides)
    activities = [ProfilerActivity.CPU]
    on_cuda = device.startswith("cuda") and torch.cuda.is_available()
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    state = {"started": False, "stopped": False}

    def hook(event: str) -> None:
        if on_cuda:
            torch.cuda.synchronize()  # warm-up work stays out of the trace; timed work is complete at stop
        if event == "start" and not state["started"]:
            prof.start()
            state["started"] = True
        elif event == "stop" and state["started"] and not state["stopped"]:
            prof.stop()
            state["stopped"] = True

    result: dict[str, Any] = {"mode": "torch.profiler", "point": point_index, "impl": point.impl,
                              "device": device, "out_dir": str(out_dir), "files": [], "summary": [], "error": None}
    try:
        point_result = _run_point(sweep, point_index, device, iters, hook)
    finally:
        if state["started"] and not state["stopped"]:
            prof.stop()  # the point raised mid-way: keep what was recorded
            state["stopped"] = True
    result["point_status"] = _status_of(point_result)
    if not state["started"]:
        result["error"] = (f"the point never reached its timed iterations (status {result['point_status']!r}): "
                           "nothing was profiled")
        return result
    trace_path = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    result["files"].append(str(trace_path))
    result["summary"] = summarize_trace(trace_path)
    return result


def profile_point(sweep_path: str | os.PathLike, point_index: int, out_dir: str | os.PathLike,
                  overrides: list[str] | None = None, device: str | None = None, *, iters: int = 20,
                  use_nsys: bool | None = None, timeout_s: float = 1800.0, echo: bool = True) -> dict:
    """Profile one point of a sweep; returns what was done (mode, files, per-range summary, error or None).

    nsys (found by find_nsys) and CUDA: the point is re-launched as `python -m moebench profile ... --inner`
    under `nsys profile` with capture limited to the timed iterations, then `nsys stats` CSVs are written next
    to the .nsys-rep. Otherwise torch.profiler records the timed iterations in this process and a chrome trace
    (trace.json) is exported; so it is too when nsys writes no report at all (its importer failing without
    libdw, say), with `nsys_error` and a `note` saying so. Either way the per-range summary goes to
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
            # nsys ran but wrote no report (its importer needs libdw.so.1: GPU.md): the point is still profiled,
            # with torch.profiler, and the result says why
            why = result["error"] or "nsys wrote no report"
            inner_log = result["files"]
            result = _profile_torch(sweep_path, point_index, out_dir, overrides, device, iters)
            result["files"] += inner_log
            result["nsys_error"] = why
            result["note"] = f"nsys wrote no report, torch.profiler used instead: {why.splitlines()[0][:200]}"
    else:
        result = _profile_torch(sweep_path, point_index, out_dir, overrides, device, iters)
    if result["summary"]:
        csv_path = write_summary_csv(result["summary"], out_dir / "profile_summary.csv")
        result["files"].append(str(csv_path))
    (out_dir / "profile.json").write_text(json.dumps(result, indent=2, default=str))
    if echo:
        print(f"# profile ({result['mode']}) of point {point_index} -> {out_dir}")
        print(format_summary(result["summary"]))
        if result.get("note"):
            print(f"# note: {result['note']}")
        if result["error"]:
            print(f"# error: {result['error']}")
    return result


def profile_inner(sweep_path: str | os.PathLike, point_index: int, overrides: list[str] | None = None,
                  device: str = "cuda", iters: int = 20) -> Any:
    """The process nsys launches (`moebench profile ... --inner`): runs the point with the CUDA profiler API
    switched on only around the timed iterations, which is what `--capture-range=cudaProfilerApi` records."""
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
