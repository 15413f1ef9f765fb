"""`nsys stats --format csv` reports -> the per-range summary shape of moebench.profile.summary.

Columns are found by header name (case-insensitive, with or without the unit suffix " (ns)"), never by position:

  nvtx_sum            Range, Instances, Total Time (ns), Avg (ns)               the ranges' host time
  nvtx_kern_sum       NVTX Range, Kern Inst, Total Time (ns), Kernel Name       kernels per range; a kernel counts
                                                                                 for every range on the stack at
                                                                                 its launch (one row per PID/TID)
  nvtx_gpu_proj_sum   Range, Total Proj Time (ns), Range Instances              the ranges projected on the GPU
  --- the fallback when nvtx_kern_sum is absent: the same attribution, joined here ---
  nvtx_pushpop_trace  Start (ns), End (ns), Name, TID                           one row per range instance
  cuda_api_trace      Start (ns), Duration (ns), CorrID, Tid                    the launching calls
  cuda_gpu_trace      Start (ns), Duration (ns), CorrId, Name                   the device work (kernels, memops)
A GPU operation belongs to a range when the API call that launched it lies inside the range on the same thread:
what nsys' own projection does (a kernel runs after its launch returns, so its GPU time is not inside the range).
"""

from __future__ import annotations

import bisect
import csv
import io
import os
from pathlib import Path
from typing import Any

from moebench.measure.nvtx import RANGE_PREFIX
from moebench.profile.summary import summary_row


def read_csv(path: str | os.PathLike) -> list[dict]:
    """Rows of an nsys CSV; banner lines before the header (no comma in them) are skipped."""
    lines = Path(path).read_text().splitlines()
    while lines and "," not in lines[0]:
        lines.pop(0)
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def _key(header: str) -> str:
    h = header.strip().lower()
    for unit in (" (ns)", " (us)", ":dur_ns", ":ts_ns"):
        if h.endswith(unit):
            h = h[: -len(unit)]
    return h


def col(row: dict, *names: str) -> Any:
    """The value of the first of `names` that the row has (header matched without case or time unit)."""
    low = {_key(k): v for k, v in row.items() if k is not None}
    for n in names:
        if _key(n) in low:
            return low[_key(n)]
    return None


def _float(v: Any) -> float | None:
    try:
        return float(str(v).replace(",", "").strip())
    except (TypeError, ValueError):
        return None


def ns_to_us(v: Any) -> float | None:
    f = _float(v)
    return None if f is None else f / 1000.0


def _int(v: Any) -> int:
    f = _float(v)
    return 0 if f is None else int(f)


def clean_range(name: Any) -> str:
    """nsys shows push/pop ranges of the default domain as ":name" (and "domain:name" otherwise)."""
    s = str(name or "").strip()
    i = s.find(RANGE_PREFIX)
    return s[i:] if i >= 0 else s


def _exists(path: str | os.PathLike | None) -> bool:
    return bool(path) and Path(path).exists()


def _ranges_from_nvtx_sum(nvtx_sum: str | os.PathLike) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in read_csv(nvtx_sum):
        name = clean_range(col(row, "Range", "Name"))
        if name.startswith(RANGE_PREFIX):
            out[name] = {"count": _int(col(row, "Instances", "Num Calls", "Count")),
                         "cpu_total_us": ns_to_us(col(row, "Total Time")),
                         "cpu_mean_us": ns_to_us(col(row, "Avg", "Average"))}
    return out


def projected_spans(nvtx_gpu_proj_sum: str | os.PathLike | None) -> dict[str, float]:
    """Range -> summed projected GPU span (us), from nvtx_gpu_proj_sum."""
    spans: dict[str, float] = {}
    if _exists(nvtx_gpu_proj_sum):
        for row in read_csv(nvtx_gpu_proj_sum):
            name = clean_range(col(row, "Range", "Name"))
            total = ns_to_us(col(row, "Total Proj Time", "Total GPU Time"))
            if name.startswith(RANGE_PREFIX) and total is not None:
                spans[name] = spans.get(name, 0.0) + total
    return spans


def kernels_per_range(nvtx_kern_sum: str | os.PathLike) -> dict[str, dict[str, tuple[int, float]]]:
    """Range -> kernel name -> (instances, total us), summed over the report's PID/TID rows."""
    out: dict[str, dict[str, tuple[int, float]]] = {}
    for row in read_csv(nvtx_kern_sum):
        name = clean_range(col(row, "NVTX Range", "Range"))
        if not name.startswith(RANGE_PREFIX):
            continue
        kernel = str(col(row, "Kernel Name", "Name") or "?")
        n, t = out.setdefault(name, {}).get(kernel, (0, 0.0))
        out[name][kernel] = (n + _int(col(row, "Kern Inst", "Kernel Instances", "Instances")),
                             t + (ns_to_us(col(row, "Total Time")) or 0.0))
    return out


def _rows_from_kernel_totals(ranges: dict[str, dict], kernels: dict[str, dict[str, tuple[int, float]]],
                             spans: dict[str, float], source: str) -> list[dict]:
    rows = []
    for name, r in ranges.items():
        row = summary_row(name, r["count"], r["cpu_total_us"], {}, "gpu_kernel", source,
                          device_span_us=spans.get(name), cpu_mean_us=r["cpu_mean_us"])
        ks = [{"name": k, "count": n, "total_us": t, "mean_us": t / n if n else 0.0}
              for k, (n, t) in kernels.get(name, {}).items()]
        row["kernels"] = sorted(ks, key=lambda k: (-k["total_us"], k["name"]))
        row["device_total_us"] = float(sum(k["total_us"] for k in ks))
        row["device_mean_us"] = row["device_total_us"] / r["count"] if r["count"] else None
        rows.append(row)
    return rows


def summarize_nsys_csv(nvtx_sum: str | os.PathLike, nvtx_kern_sum: str | os.PathLike | None = None,
                       nvtx_gpu_proj_sum: str | os.PathLike | None = None) -> list[dict]:
    """Per-range summary from nvtx_sum (count, host time), nvtx_kern_sum (kernels and device time per range)
    and nvtx_gpu_proj_sum (projected span); without nvtx_kern_sum the device columns stay None."""
    ranges = _ranges_from_nvtx_sum(nvtx_sum)
    spans = projected_spans(nvtx_gpu_proj_sum)
    if _exists(nvtx_kern_sum):
        return _rows_from_kernel_totals(ranges, kernels_per_range(nvtx_kern_sum), spans, "nvtx_kern_sum")
    rows = []
    for name, r in ranges.items():
        row = summary_row(name, r["count"], r["cpu_total_us"], {}, "gpu_kernel", "", device_span_us=spans.get(name),
                          cpu_mean_us=r["cpu_mean_us"])
        row["device_total_us"] = row["device_mean_us"] = None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Fallback: the attribution joined from the three traces
# ---------------------------------------------------------------------------------------------------------------

def join_traces(pushpop_rows: list[dict], api_rows: list[dict], gpu_rows: list[dict]) -> list[dict]:
    """Per-range summary from parsed nvtx_pushpop_trace, cuda_api_trace and cuda_gpu_trace rows: each GPU
    operation goes (by correlation id) to its launching call, and that call to every moebench range instance
    that contains it on the same thread (threads compared only when both reports name them)."""
    ops_by_corr: dict[int, list[tuple[str, float]]] = {}
    for row in gpu_rows:
        corr, dur = _float(col(row, "CorrId", "CorrID", "Correlation ID")), ns_to_us(col(row, "Duration"))
        if corr is not None and dur is not None:
            ops_by_corr.setdefault(int(corr), []).append((str(col(row, "Name") or "?"), dur))
    calls = []  # (start ns, end ns, tid, corr) of the calls that launched device work
    for row in api_rows:
        corr, start = _float(col(row, "CorrID", "CorrId", "Correlation ID")), _float(col(row, "Start"))
        if corr is None or start is None or int(corr) not in ops_by_corr:
            continue
        tid = col(row, "Tid", "TID")
        calls.append((start, start + (_float(col(row, "Duration")) or 0.0), str(tid) if tid else None, int(corr)))
    calls.sort()
    starts = [c[0] for c in calls]

    order: list[str] = []
    acc: dict[str, dict] = {}
    rows = sorted(pushpop_rows, key=lambda r: _float(col(r, "Start")) or 0.0)
    for row in rows:
        name = clean_range(col(row, "Name"))
        start, end = _float(col(row, "Start")), _float(col(row, "End"))
        if not name.startswith(RANGE_PREFIX) or start is None:
            continue
        if end is None:
            end = start + (_float(col(row, "Duration")) or 0.0)
        tid = col(row, "TID", "Tid")
        tid = str(tid) if tid else None
        a = acc.get(name)
        if a is None:
            order.append(name)
            a = acc[name] = {"count": 0, "cpu_ns": 0.0, "work": {}}
        a["count"] += 1
        a["cpu_ns"] += end - start
        for c_start, c_end, c_tid, corr in calls[bisect.bisect_left(starts, start):]:
            if c_start > end:
                break
            if c_end <= end and (tid is None or c_tid is None or tid == c_tid):
                for op, dur in ops_by_corr[corr]:
                    a["work"].setdefault(op, []).append(dur)
    return [summary_row(n, acc[n]["count"], acc[n]["cpu_ns"] / 1000.0, acc[n]["work"], "gpu_kernel", "trace join")
            for n in order]


def summarize_nsys_traces(pushpop_trace: str | os.PathLike, cuda_api_trace: str | os.PathLike,
                          cuda_gpu_trace: str | os.PathLike,
                          nvtx_gpu_proj_sum: str | os.PathLike | None = None) -> list[dict]:
    """join_traces over the three CSV files, with the projected spans when nvtx_gpu_proj_sum is there."""
    rows = join_traces(read_csv(pushpop_trace), read_csv(cuda_api_trace), read_csv(cuda_gpu_trace))
    spans = projected_spans(nvtx_gpu_proj_sum)
    for r in rows:
        r["device_span_us"] = spans.get(r["range"])
    return rows
