"""`moebench compare RUN_A RUN_B`: p50 ratio (B / A) for every point present in both runs with status ok."""

from __future__ import annotations

import math
from pathlib import Path

from moebench.run.results import load_manifest, load_records, unique_records


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
                     "ratio": b / a if a else float("nan"),
                     "a_gpu_state": ra.get("gpu_state"), "b_gpu_state": rb.get("gpu_state")})
    return rows


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


def compare_runs(run_a: Path, run_b: Path) -> int:
    for d in (run_a, run_b):
        if not (d / "records.jsonl").exists():
            raise ValueError(f"{d}: not a run directory (no records.jsonl)")
    rows = compare_records(unique_records(load_records(run_a)), unique_records(load_records(run_b)))
    axes = list((load_manifest(run_b).get("sweep") or {}).get("axes") or {})
    print(f"# compare A={run_a} B={run_b}: p50 ratio B/A (< 1: B faster), {len(rows)} matching points")
    tables = [(load_manifest(d).get("tuned_tables") or {}).get("sha256") for d in (run_a, run_b)]
    if all(tables) and tables[0] != tables[1]:  # points that name no config may have launched differently
        print(f"# note: the tuned tables differ (A {tables[0][:12]}, B {tables[1][:12]}): see each record's "
              "info.config / info.config_source")
    head = f"# {'impl':<32}" + "".join(f"{k[:10]:>11}" for k in axes) + f"{'A p50 us':>12}{'B p50 us':>12}{'B/A':>8}"
    print(head)
    for r in rows:
        line = f"  {r['impl'][:32]:<32}" + "".join(f"{str(r['params'].get(k))[:10]:>11}" for k in axes)
        print(line + f"{r['a_p50_us']:>12.2f}{r['b_p50_us']:>12.2f}{r['ratio']:>8.3f}")
    clocks = clock_line(rows)
    if clocks:
        print(clocks)
    finite = [r["ratio"] for r in rows if r["ratio"] > 0 and math.isfinite(r["ratio"])]
    if finite:
        gm = math.exp(sum(math.log(x) for x in finite) / len(finite))
        print(f"# geometric mean B/A: {gm:.3f} over {len(finite)} points")
    else:
        print("# no matching ok points")
    return 0
