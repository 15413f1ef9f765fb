"""`moebench compare RUN_A RUN_B`: p50 ratio (B / A) for every point present in both runs with status ok.

A point whose cv (stdev / mean of its samples) is above the threshold in either run (`--max-cv`, default 10%) is
flagged `noisy`: its ratio is printed but left out of the geometric means, and the summary says how many were. The
geometric mean is given over all the points kept and per impl. A point whose ratio is far outside both runs' own
spread is flagged `outside spread` (moebench.report.machine), one inside it (within twice their combined cv)
`within noise` (moebench.report.noise), as the headlines and the report mark such figures. Both runs' machine references (a fixed matmul and a
copy at each run's start and end) are printed, and a geometric mean no larger than the machines' difference is said
not to be a speed-up or slow-down. For serving_trace points the trace's answers follow (report.trace_compare: the EP
step and the layer over the trace per side, with the models' errors, and the tax). When no point matches, the command says why, one line per thing that differs
between the runs (sweep, target, impls, parameter keys and values), and exits 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from moebench.report import cells, machine, noise, trace_compare
from moebench.records import load_manifest, load_records, unique_records

MAX_CV = 0.10  # the default cv above which a point is too noisy to enter a geometric mean
MAX_VALUES = 6  # values listed per differing parameter


def compare_records(records_a: list[dict], records_b: list[dict]) -> list[dict]:
    """Match points by their key (impl + every parameter) and return one row per matching ok pair."""
    by_key = {r["key"]: r for r in records_a if r.get("status") == "ok" and "key" in r}
    rows = []
    for rb in records_b:
        ra = by_key.get(rb.get("key"))
        if ra is None or rb.get("status") != "ok":
            continue
        a, b = ra["stats"]["p50"], rb["stats"]["p50"]
        rows.append({"impl": rb["impl"], "params": rb["params"], "a_p50_us": a, "b_p50_us": b,
                     "a_cv": ra["stats"].get("cv"), "b_cv": rb["stats"].get("cv"),
                     "ratio": b / a if a else float("nan"),
                     "a_gpu_state": ra.get("gpu_state"), "b_gpu_state": rb.get("gpu_state")})
    return rows


def is_noisy(row: dict, max_cv: float = MAX_CV) -> bool:
    """Whether either side's cv is above max_cv (a point without a cv is not flagged)."""
    return any(isinstance(row.get(k), (int, float)) and row[k] > max_cv for k in ("a_cv", "b_cv"))


def geomean(values: list[float]) -> float | None:
    kept = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else None


def clock_line(rows: list[dict]) -> str | None:
    """One line on the GPU's SM clock at the end of each side's timed regions (median over the matched points) and
    how many points were throttled (a reason other than idle), when the records carry gpu_state; else None."""
    parts = []
    for side in ("a", "b"):
        ends = [(r[f"{side}_gpu_state"] or {}).get("stop") or {} for r in rows]
        mhz = sorted(e["sm_clock_mhz"] for e in ends if "sm_clock_mhz" in e)
        if not mhz:
            continue
        throttled = sum(1 for e in ends if set(e.get("throttle") or ()) - {"gpu_idle"})
        parts.append(f"{side.upper()} median {mhz[len(mhz) // 2]} MHz (range {mhz[0]}-{mhz[-1]}), "
                     f"{throttled} of {len(mhz)} points throttled")
    return "# SM clock at the end of the timed regions: " + "; ".join(parts) if parts else None


def _values(records: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in records:
        for k, v in (r.get("params") or {}).items():
            out.setdefault(k, set()).add(json.dumps(v, sort_keys=True, default=str))
    return out


def _listed(values: set[str], as_json: bool = False) -> str:
    """Names, or parameter values (as JSON: numbers sorted by value), the first MAX_VALUES of them."""
    if as_json:
        decoded = [json.loads(v) for v in values]
        nums = sorted(v for v in decoded if isinstance(v, (int, float)) and not isinstance(v, bool))
        rest = sorted((v for v in decoded if not isinstance(v, (int, float)) or isinstance(v, bool)), key=str)
        vals = [cells.plain(v) for v in nums + rest]
    else:
        vals = sorted(values)
    return ", ".join(vals[:MAX_VALUES]) + (f", ... ({len(vals)} in all)" if len(vals) > MAX_VALUES else "")


def differences(manifest_a: dict, records_a: list[dict], manifest_b: dict, records_b: list[dict]) -> list[str]:
    """Why two runs have no ok point in common: one line per thing that differs (sweep name, target, impls,
    parameter keys, parameter values), or, when none does, what keeps the points they share apart."""
    lines = []
    for what in ("name", "target"):
        va, vb = ((m.get("sweep") or {}).get(what) for m in (manifest_a, manifest_b))
        if va != vb:
            lines.append(f"sweep {what}: A {va}, B {vb}")
    impls_a, impls_b = ({str(r.get("impl")) for r in recs} for recs in (records_a, records_b))
    if impls_a != impls_b:
        parts = [f"only in A: {_listed(impls_a - impls_b)}" if impls_a - impls_b else "",
                 f"only in B: {_listed(impls_b - impls_a)}" if impls_b - impls_a else ""]
        lines.append("impls: " + "; ".join(p for p in parts if p) + (
            f" (in both: {_listed(impls_a & impls_b)})" if impls_a & impls_b else " (none in both)"))
    vals_a, vals_b = _values(records_a), _values(records_b)
    for side, mine, other in (("A", vals_a, vals_b), ("B", vals_b, vals_a)):
        only = sorted(set(mine) - set(other))
        if only:
            lines.append(f"parameter keys only in {side}: {', '.join(only)}")
    for k in sorted(set(vals_a) & set(vals_b)):
        if vals_a[k] != vals_b[k]:
            lines.append(f"{k}: A {_listed(vals_a[k], True)}; B {_listed(vals_b[k], True)}")
    if lines:
        return lines
    keys_a = {r.get("key") for r in records_a}
    shared = [r for r in records_b if r.get("key") in keys_a]
    if not shared:
        return ["the runs hold the same impls and parameter values but no (impl, parameters) combination in common"]
    ok_a = {r.get("key") for r in records_a if r.get("status") == "ok"}
    status = {}
    for r in shared:
        status[r.get("status", "?")] = status.get(r.get("status", "?"), 0) + 1
    return [f"{len(shared)} points are in both runs, none ok in both: B's statuses there "
            + ", ".join(f"{k} {v}" for k, v in sorted(status.items()))
            + f"; A's ok there: {sum(1 for r in shared if r.get('key') in ok_a)}"]


def _axes(manifest: dict, rows: list[dict]) -> list[str]:
    """The columns that tell the rows apart: the sweep's axes, else the parameters that vary."""
    axes = list((manifest.get("sweep") or {}).get("axes") or {})
    if axes:
        return axes
    return [k for k, vals in _values([{"params": r["params"]} for r in rows]).items() if len(vals) > 1]


def compare_runs(run_a: Path, run_b: Path, max_cv: float = MAX_CV, out=None, err=None) -> int:
    """Print the table and the geometric means; 0, or 2 (with the reasons on stderr) when no point matches."""
    out, err = out or sys.stdout, err or sys.stderr
    for d in (run_a, run_b):
        if not (d / "records.jsonl").exists():
            raise ValueError(f"{d}: not a run directory (no records.jsonl)")
    recs_a, recs_b = unique_records(load_records(run_a)), unique_records(load_records(run_b))
    man_a, man_b = load_manifest(run_a), load_manifest(run_b)
    rows = compare_records(recs_a, recs_b)
    if not rows:
        err.write(f"moebench: compare: 0 matching points between A={run_a} and B={run_b}:\n")
        for line in differences(man_a, recs_a, man_b, recs_b):
            err.write(f"  {line}\n")
        return 2
    limit = f"{100 * max_cv:g}%"
    print(f"# compare A={run_a} B={run_b}: p50 ratio B/A (< 1: B faster), {len(rows)} matching points; "
          f"noisy: cv above {limit} in either run (left out of the geometric means)", file=out)
    tables = [(m.get("tuned_tables") or {}).get("sha256") for m in (man_a, man_b)]
    if all(tables) and tables[0] != tables[1]:  # points that name no config may have launched differently
        print(f"# note: the tuned tables differ (A {tables[0][:12]}, B {tables[1][:12]}): see each record's "
              "info.config / info.config_source", file=out)
    axes = _axes(man_b, rows)
    table = [[r["impl"], *(cells.plain(r["params"].get(k)) for k in axes), cells.us(r["a_p50_us"]),
              cells.pct(r["a_cv"]), cells.us(r["b_p50_us"]), cells.pct(r["b_cv"]), cells.ratio(r["ratio"]),
              _flags(r, max_cv)] for r in rows]
    for line in cells.columns(["impl", *axes, "A p50 us", "A cv %", "B p50 us", "B cv %", "B/A", "flag"], table):
        print(line, file=out)
    clocks = clock_line(rows)
    if clocks:
        print(clocks, file=out)
    for line in machine.reference_lines(man_a, man_b) + summary_lines(rows, max_cv):
        print(line, file=out)
    for line in trace_compare.lines(recs_a, recs_b):  # a serving_trace run's answers, not its one timed shape
        print(line, file=out)
    caveat = machine.verdict(geomean([r["ratio"] for r in rows if not is_noisy(r, max_cv)]), man_a, man_b)
    if caveat:
        print(caveat, file=out)
    return 0


def _flags(row: dict, max_cv: float) -> str:
    """noisy (cv over the limit), within noise (the change is inside the two points' spread: no speed-up or
    slow-down), outside spread (far outside it)."""
    quiet = noise.ratio_within_noise(row.get("ratio"), row.get("a_cv"), row.get("b_cv"))
    return ", ".join(f for f, on in (("noisy", is_noisy(row, max_cv)), ("within noise", quiet),
                                     ("outside spread", machine.outside_spread(row))) if on)


def summary_lines(rows: list[dict], max_cv: float = MAX_CV) -> list[str]:
    """The geometric mean of B/A over the points that are not noisy, overall and per impl."""
    kept = [r for r in rows if not is_noisy(r, max_cv)]
    noisy = len(rows) - len(kept)
    left = f" ({noisy} noisy point{'s' if noisy != 1 else ''} left out: cv above {100 * max_cv:g}%)" if noisy else ""
    gm = geomean([r["ratio"] for r in kept])
    if gm is None:
        return [f"# geometric mean B/A: none, no point below the cv threshold{left}"]
    lines = [f"# geometric mean B/A: {cells.ratio(gm)} over {len(kept)} points{left}"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    if len(impls) > 1:
        per = []
        for impl in impls:
            mine = [r for r in rows if r["impl"] == impl]
            ratios = [r["ratio"] for r in mine if not is_noisy(r, max_cv)]
            g = geomean(ratios)
            per.append([impl, cells.ratio(g), str(len(ratios)), str(len(mine) - len(ratios))])
        lines += cells.columns(["per impl", "B/A", "points", "noisy left out"], per)
    return lines


def max_cv_arg(text: str) -> float:
    """`--max-cv PCT` as a fraction (a percentage above 0)."""
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--max-cv {text}: expected a percentage, e.g. 10") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"--max-cv {text}: expected a percentage above 0, e.g. 10")
    return v / 100
