"""Per-range summaries of a profile: from a torch.profiler chrome trace or from `nsys stats` CSVs, both into one
shape (range, count, CPU and device time, the kernels inside), written as CSV and printed as a table."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from moebench.measure.nvtx import RANGE_PREFIX


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
