"""Per-range summaries of a profile: from a torch.profiler chrome trace (here) or from `nsys stats` CSVs
(moebench.profile.nsys_reports), both into one shape, then the stage breakdown, the CSV and the printed table.

One summary row per NVTX range name:
  range, count, cpu_total_us / cpu_mean_us   the ranges' host (push to pop) time
  device_total_us / device_mean_us           GPU time of the work launched inside the range: the sum of its
                                             kernels' (and, torch.profiler, memcpy/memset) durations; None when
                                             the profile has no device activity (CPU)
  device_source                              where that came from: "nvtx_kern_sum", "trace join", "kernels"
  device_span_us                             first start to last end of that work per instance, summed (nsys'
                                             projection, torch.profiler's gpu_user_annotation), when known
  kernel_kind, kernels                       what ran inside: GPU kernels by total time ("gpu_kernel") or, on a
                                             CPU ("cpu_op"), the top-level work: each Triton kernel that ran in
                                             Triton's interpreter (`triton/<kernel>`, moebench.profile.interpreted)
                                             and the torch ops outside them
  parent, device_share, wall_share           (add_breakdown) the enclosing range, and the share of the point's
                                             (outermost range's) device time and of its wall (host) time
Work launched inside a nested range counts for the enclosing ranges too (as nsys' nvtx_kern_sum counts it).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from moebench.measure.nvtx import RANGE_PREFIX
from moebench.profile.interpreted import KERNEL_RANGE_PREFIX


def summary_row(name: str, count: int, cpu_total_us: float | None, work: dict[str, list[float]],
                kernel_kind: str = "gpu_kernel", device_source: str = "kernels",
                device_span_us: float | None = None, cpu_mean_us: float | None = None) -> dict:
    """One row of the summary shape from raw figures; `work`: kernel (or CPU op) name -> durations (us), listed
    by total time, largest first. Device time is the kernels' sum; None for kernel_kind "cpu_op"."""
    ks = sorted(({"name": k, "count": len(v), "total_us": float(sum(v)), "mean_us": sum(v) / len(v) if v else 0.0}
                 for k, v in work.items()), key=lambda k: (-k["total_us"], k["name"]))
    device_total = None if kernel_kind == "cpu_op" else float(sum(k["total_us"] for k in ks))
    if cpu_mean_us is None and cpu_total_us is not None and count:
        cpu_mean_us = cpu_total_us / count
    return {"range": name, "count": count, "cpu_total_us": cpu_total_us, "cpu_mean_us": cpu_mean_us,
            "device_total_us": device_total,
            "device_mean_us": None if device_total is None or not count else device_total / count,
            "device_source": device_source if device_total is not None else "", "kernel_kind": kernel_kind,
            "kernels": ks, "device_span_us": device_span_us}


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

    Ranges: record_function / NVTX ranges (category `user_annotation`) whose name starts with `prefix`, in order
    of first appearance. Device work reaches a range through the launching runtime call's correlation id (the
    launch lies inside the range on the same thread); its span comes from the GPU-side projection of the range
    (`gpu_user_annotation`) when the trace has one. Without device activity (CPU), the top-level CPU ops inside
    each range are listed instead, with the interpreted Triton launches (`triton/<kernel>` ranges) as ops of their
    own (the torch calls inside such a launch are the interpreter's, not the stage's), and the device columns stay
    None: the range's own (wall) time is its figure.
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
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"
               or (e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(KERNEL_RANGE_PREFIX))]

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
        work: dict[str, list[float]] = {}
        if have_device:
            for r in inst:
                for launch in launches:
                    if inside(launch, r):
                        for k in device_by_corr.get((launch.get("args") or {}).get("correlation"), []):
                            work.setdefault(k["name"], []).append(float(k["dur"]))
        else:
            for r in inst:
                for op in _top_level_ops([o for o in cpu_ops if inside(o, r)]):
                    work.setdefault(op["name"], []).append(float(op["dur"]))
        spans = [float(g["dur"]) for g in gpu_ranges if g["name"] == name]
        summary.append(summary_row(name, len(inst), float(sum(r["dur"] for r in inst)), work,
                                   "gpu_kernel" if have_device else "cpu_op", "kernels",
                                   device_span_us=sum(spans) if spans else None))
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Stage breakdown: parents and shares
# ---------------------------------------------------------------------------------------------------------------

def add_breakdown(summary: list[dict]) -> list[dict]:
    """Set each row's `parent` (the longest other range name that prefixes it followed by "/", "" for none),
    `device_share` (its device time over its outermost ancestor's, i.e. the point's; None without device time) and
    `wall_share` (the same for the ranges' wall time on the host: the figure of a CPU profile).
    Rows are reordered so that each range is followed by its children (first-appearance order otherwise)."""
    names = [s["range"] for s in summary]
    by_name = {s["range"]: s for s in summary}
    for s in summary:
        cands = [n for n in names if n != s["range"] and s["range"].startswith(n + "/")]
        s["parent"] = max(cands, key=len) if cands else ""

    def root(s: dict) -> dict:
        while s["parent"]:
            s = by_name[s["parent"]]
        return s

    def share(s: dict, key: str) -> float | None:
        top = root(s)[key]
        return s[key] / top if s[key] is not None and top else None

    for s in summary:
        s["device_share"] = share(s, "device_total_us")
        s["wall_share"] = share(s, "cpu_total_us")
    ordered: list[dict] = []

    def visit(s: dict) -> None:
        ordered.append(s)
        for c in summary:
            if c["parent"] == s["range"]:
                visit(c)

    for s in summary:
        if not s["parent"]:
            visit(s)
    return ordered


# ---------------------------------------------------------------------------------------------------------------
# CSV and printed table
# ---------------------------------------------------------------------------------------------------------------

CSV_COLUMNS = ("range", "count", "cpu_total_us", "cpu_mean_us", "device_total_us", "device_mean_us",
               "device_source", "kernel_kind", "kernel", "kernel_count", "kernel_total_us", "kernel_mean_us",
               "parent", "device_share", "device_span_us", "launch", "wall_share")


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3g}"
    return str(v)


def write_summary_csv(summary: list[dict], path: str | os.PathLike, launch: str = "") -> Path:
    """One row per (range, kernel); a range without kernels gets one row with empty kernel columns. `launch`
    says how the profiled work was launched (e.g. "eager launches"), repeated on every row."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for s in summary:
            head = [s["range"], s["count"], s["cpu_total_us"], s["cpu_mean_us"], s["device_total_us"],
                    s["device_mean_us"], s["device_source"], s["kernel_kind"]]
            tail = [s.get("parent", ""), s.get("device_share"), s.get("device_span_us"), launch, s.get("wall_share")]
            rows = [[k["name"], k["count"], k["total_us"], k["mean_us"]] for k in s["kernels"]] or [[None] * 4]
            for row in rows:
                w.writerow([_fmt(v) for v in head + row + tail])
    return path


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def has_device_time(summary: list[dict]) -> bool:
    """Whether any range of the summary has device time (a GPU profile); without it (a CPU profile) the ranges'
    wall time is the figure, and their shares are of the point's wall time."""
    return any(s.get("device_total_us") is not None for s in summary)


def format_summary(summary: list[dict], max_kernels: int = 3, header: str = "") -> str:
    """The printed table: one line per range (stages indented under the point's range), its top `max_kernels`
    kernels (or CPU ops) below it with count and total time. With device time (a GPU profile) the columns are
    host and device time and the share of the point's device time; without (a CPU profile) the ranges' wall time
    and the share of the point's wall time. `header` (how the work was launched and timed; one comment line per
    line) is printed first."""
    if not summary:
        return f"# no {RANGE_PREFIX}... ranges in the profile"
    depth = {s["range"]: 0 for s in summary}
    for s in summary:
        p = s.get("parent") or ""
        depth[s["range"]] = depth.get(p, -1) + 1 if p else 0
    width = max(40, max(len(s["range"]) + 2 * depth[s["range"]] for s in summary) + 2)
    device = has_device_time(summary)
    lines = [f"# {h}" for h in header.splitlines()]
    if device:
        lines += [f"{'range':<{width}}{'count':>7}{'cpu total':>14}{'cpu/call':>12}{'dev total':>14}"
                  f"{'dev/call':>12}{'share':>8}",
                  f"{'':<{width}}{'':>7}{'(us)':>14}{'(us)':>12}{'(us)':>14}{'(us)':>12}{'':>8}"]
    else:
        lines += [f"{'range':<{width}}{'count':>7}{'wall total':>14}{'wall/call':>12}{'share':>8}",
                  f"{'':<{width}}{'':>7}{'(us)':>14}{'(us)':>12}{'':>8}"]
    for s in summary:
        ind = "  " * depth[s["range"]]
        row = f"{ind + s['range']:<{width}}{s['count']:>7} {_num(s['cpu_total_us']):>13} {_num(s['cpu_mean_us']):>11}"
        if device:
            row += (f" {_num(s['device_total_us']):>13} {_num(s['device_mean_us']):>11}"
                    f"{_share(s.get('device_share')):>8}")
        else:
            row += f"{_share(s.get('wall_share')):>8}"
        lines.append(row)
        kind = "kernel" if s["kernel_kind"] == "gpu_kernel" else "item"
        room = width - len(ind) - 4
        for k in s["kernels"][:max_kernels]:
            name = k["name"] if len(k["name"]) <= room else k["name"][: room - 3] + "..."
            lines.append(f"{ind}    {name:<{room}}{k['count']:>7} {_num(k['total_us']):>13}")
        if len(s["kernels"]) > max_kernels:
            lines.append(f"{ind}    ... {len(s['kernels']) - max_kernels} more {kind}s in the CSV")
    return "\n".join(lines)
