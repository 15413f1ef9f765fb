"""Whether two runs' machines were alike enough for `moebench compare` to call a speed-up or a slow-down.

Each run keeps a reference measurement of its machine at its start and end (manifest `machine_reference`,
moebench.measure.machine_reference: a fixed matmul and a copy). The machine change between the runs is the larger
of the two workloads' B/A (each side the mean of its start and end); a run whose own start and end differ has a
machine that changed under it, and that drift counts too. A geometric mean B/A whose change from 1 is not larger
than the machine change is not a result: compare says so instead of presenting it.

A point's ratio is `outside spread` when it is farther from 1 than both runs' own spread allows (SPREAD_SIGMAS of
the combined cv, in log terms) and by more than MIN_CHANGE: what a disturbed machine or a changed code path gives,
worth a look before it is believed.
"""

from __future__ import annotations

import math
from typing import Any

from moebench.report import cells

WORKLOADS = ("matmul_us", "copy_us")
SPREAD_SIGMAS = 5.0
MIN_CHANGE = 0.10  # a ratio within 10% of 1 is never flagged for its spread


def _mean_reference(manifest: dict, what: str) -> float | None:
    refs = manifest.get("machine_reference") or {}
    vals = [refs[w][what] for w in ("start", "end")
            if isinstance(refs.get(w), dict) and isinstance(refs[w].get(what), (int, float)) and refs[w][what] > 0]
    return sum(vals) / len(vals) if vals else None


def _drift(manifest: dict) -> float:
    """The largest |ln(end / start)| of the run's own reference (0 without both ends)."""
    refs = manifest.get("machine_reference") or {}
    start, end = refs.get("start") or {}, refs.get("end") or {}
    out = 0.0
    for what in WORKLOADS:
        a, b = start.get(what), end.get(what)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
            out = max(out, abs(math.log(b / a)))
    return out


def machine_change(manifest_a: dict, manifest_b: dict) -> float | None:
    """The machines' difference as |ln ratio|: the references' B/A and each run's own drift; None when either run
    has no reference (a run from before it was recorded)."""
    logs = []
    for what in WORKLOADS:
        a, b = _mean_reference(manifest_a, what), _mean_reference(manifest_b, what)
        if a and b:
            logs.append(abs(math.log(b / a)))
    if not logs:
        return None
    return max(logs + [_drift(manifest_a), _drift(manifest_b)])


def _side(manifest: dict) -> str:
    refs = manifest.get("machine_reference") or {}
    parts = []
    for when in ("start", "end"):
        r = refs.get(when)
        if isinstance(r, dict):
            parts.append(f"{when} matmul {cells.plain(r.get('matmul_us'))} us, copy {cells.plain(r.get('copy_us'))} us")
    return "; ".join(parts) if parts else "not recorded"


def reference_lines(manifest_a: dict, manifest_b: dict) -> list[str]:
    """Both runs' machine references, one line each."""
    return [f"# machine reference A: {_side(manifest_a)}", f"# machine reference B: {_side(manifest_b)}"]


def verdict(geomean_ratio: float | None, manifest_a: dict, manifest_b: dict) -> str | None:
    """None when the geometric mean may be read as a result; else the one line saying why it may not."""
    if geomean_ratio is None or not geomean_ratio > 0:
        return None
    change = machine_change(manifest_a, manifest_b)
    if change is None:
        return "# note: a run has no machine reference: whether the machines differed is unknown"
    claimed = abs(math.log(geomean_ratio))
    if change >= claimed:
        return (f"# NOT a speed-up or slow-down: the machines' references differ by {cells.ratio(math.exp(change))}x "
                f"(the larger of B/A and each run's start-to-end drift), at least the claimed change "
                f"{cells.ratio(geomean_ratio)}: rerun both on one quiet machine")
    return None


def outside_spread(row: dict[str, Any]) -> bool:
    """Whether a point's B/A is far outside both runs' own spread (cv as a fraction)."""
    ratio = row.get("ratio")
    cvs = [row.get(k) for k in ("a_cv", "b_cv")]
    if not isinstance(ratio, (int, float)) or not ratio > 0 or not all(isinstance(c, (int, float)) for c in cvs):
        return False
    change = abs(math.log(ratio))
    return change > math.log(1 + MIN_CHANGE) and change > SPREAD_SIGMAS * math.hypot(*cvs)
