"""Each impl against the best available peer at the same point, from a run's records (nothing is re-run).

A peer is an outside implementation: an impl registered with `library` set (torch.compile, torch, vllm, sglang,
flashinfer, deep_gemm, a user's plugin); the runner writes it into every record. Two records are at the same point
when their kernel family and every parameter agree (only the impl differs). For every ok record at a point with at
least one other ok peer record of the same expert dtype (where records name one), `peer_ratio` = its p50 / the lowest p50 among those other peers (`best_peer`): below
1 it is faster than every peer there. Ceiling records (`ceiling` set: torch's GEMMs alone) are neither peers nor
compared; report.ceiling pairs records with them. Used by the table's "vs best peer" footer, `moebench compare RUN`
(within one run) and the peer_ratio plot.

Two records timed in different modes (moebench.records.timing_label: an interpreted Triton kernel against a torch
row on a CPU) are not comparable: the row keeps its ratio but `comparable` is False, and every place that prints it
gives `ratio_text` (the modes, never a number like 1298x) and the CPU caveat instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moebench.records import timing_label
from moebench.report import cells

__all__ = ["point_of", "p50_of", "peer_ratios", "peer_footer_lines", "compare_within", "compare_within_run",
           "ratio_text", "MODES_DIFFER"]

MODES_DIFFER = ("ratios between rows timed in different modes (an interpreted Triton kernel against torch on the "
                "CPU) are not given: they say nothing of a GPU")


def point_of(rec: dict) -> str:
    """The identity of a record's point without its impl: kernel family + every parameter."""
    kernel = rec.get("kernel") or str(rec.get("impl", "")).split(".", 1)[0]
    return json.dumps({"kernel": kernel, "params": rec.get("params") or {}}, sort_keys=True, default=str)


def p50_of(rec: dict) -> float | None:
    """An ok record's p50 (us), or None."""
    if rec.get("status") != "ok":
        return None
    v = (rec.get("stats") or {}).get("p50")
    return float(v) if isinstance(v, (int, float)) and v > 0 and math.isfinite(v) else None


def _by_point(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        if p50_of(r) is not None:
            groups.setdefault(point_of(r), []).append(r)
    return groups


def _same_expert_dtype(a: dict, b: dict) -> bool:
    """bf16 and fp8 experts at one point are different work: a record names its expert_dtype (where it has one)
    and is compared with peers of the same, or of none named."""
    da, db = ((r.get("info") or {}).get("expert_dtype") for r in (a, b))
    return da is None or db is None or da == db


def peer_ratios(records: list[dict]) -> list[dict]:
    """One row per ok record that has another ok peer at its point: impl, library, point, params, p50, best_peer,
    best_peer_p50, ratio (p50 / best_peer_p50). In record order."""
    rows = []
    groups = _by_point(records)
    for r in records:
        p50 = p50_of(r)
        if p50 is None or r.get("ceiling"):  # a measured ceiling is no implementation (report.ceiling)
            continue
        peers = [o for o in groups[point_of(r)] if o.get("library") and o.get("impl") != r.get("impl")
                 and _same_expert_dtype(o, r)]
        if not peers:
            continue
        best = min(peers, key=p50_of)
        modes = (timing_label(r), timing_label(best))
        rows.append({"point": r.get("point"), "impl": r.get("impl"), "library": r.get("library"),
                     "params": r.get("params") or {}, "p50": p50, "best_peer": best.get("impl"),
                     "best_peer_p50": p50_of(best), "ratio": p50 / p50_of(best), "modes": modes,
                     "comparable": modes[0] == modes[1]})
    return rows


def ratio_text(row: dict) -> str:
    """A peer row's ratio as printed: the number, or the two timing modes where they differ."""
    if row.get("comparable", True):
        return cells.ratio(row["ratio"])
    return f"{row['modes'][0]} vs {row['modes'][1]}"


def _varying(rows: list[dict]) -> list[str]:
    keys: dict[str, set] = {}
    for r in rows:
        for k, v in r["params"].items():
            keys.setdefault(k, set()).add(json.dumps(v, default=str))
    return [k for k, vals in keys.items() if len(vals) > 1]


def _label(params: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={params.get(k)}" for k in keys)


def peer_footer_lines(records: list[dict]) -> list[str]:
    """The "vs best peer" block under the table (empty when the run has no peer to compare with)."""
    rows = peer_ratios(records)
    if not rows:
        return []
    keys = _varying(rows)
    table = [[str(r["point"]), str(r["impl"]), cells.us(r["p50"]), str(r["best_peer"]), cells.us(r["best_peer_p50"]),
              ratio_text(r), _label(r["params"], keys)] for r in rows]
    caveat = [f"  ({MODES_DIFFER})"] if not all(r["comparable"] for r in rows) else []
    return ["", "vs best peer: p50 / the fastest other peer's p50 at the same point (< 1: faster than every peer)",
            *cells.columns(["point", "impl", "p50 us", "best peer", "peer us", "ratio", "params"], table,
                           head_prefix="  ", right=[True, False, True, False, True, True, False]), *caveat]


def compare_within(records: list[dict], impl_a: str, impl_b: str) -> list[dict]:
    """B / A per point where both impls have an ok record: rows of params, a_p50_us, b_p50_us, ratio."""
    at: dict[tuple[str, str], dict] = {}
    for r in records:
        if p50_of(r) is not None:
            params = json.dumps(r.get("params") or {}, sort_keys=True, default=str)
            at[(str(r.get("impl")), params)] = r
    rows = []
    for (impl, params), ra in at.items():
        if impl != impl_a:
            continue
        rb = at.get((impl_b, params))
        if rb is None:
            continue
        rows.append({"params": ra.get("params") or {}, "a_p50_us": p50_of(ra), "b_p50_us": p50_of(rb),
                     "ratio": p50_of(rb) / p50_of(ra)})
    return rows


def compare_within_run(run_dir: Path, impls: str | None = None) -> int:
    """`moebench compare RUN [--impls A,B]`: B/A per point of one run, or (no --impls) every impl vs best peer."""
    from moebench.records import load_records

    if not (Path(run_dir) / "records.jsonl").exists():
        raise ValueError(f"{run_dir}: not a run directory (no records.jsonl)")
    records = load_records(Path(run_dir))
    if not impls:
        lines = peer_footer_lines(records)
        print(f"# {run_dir}: every impl against the best peer at the same point")
        for line in lines or ["", "no point has an ok peer record to compare with"]:
            print(f"# {line}" if not line.startswith("  ") else line)
        return 0
    names = [s.strip() for s in impls.split(",") if s.strip()]
    if len(names) != 2:
        raise ValueError(f"--impls {impls}: expected two impl names, A,B")
    rows = compare_within(records, names[0], names[1])
    keys = _varying([{"params": r["params"]} for r in rows])
    print(f"# compare within {run_dir}: A={names[0]} B={names[1]}, p50 ratio B/A (< 1: B faster), "
          f"{len(rows)} matching points")
    print(f"# {'A p50 us':>10} {'B p50 us':>10} {'B/A':>7}  params")
    for r in rows:
        print(f"  {r['a_p50_us']:>10.2f} {r['b_p50_us']:>10.2f} {r['ratio']:>7.3f}  {_label(r['params'], keys)}")
    finite = [r["ratio"] for r in rows if r["ratio"] > 0 and math.isfinite(r["ratio"])]
    if finite:
        print(f"# geometric mean B/A: {math.exp(sum(math.log(x) for x in finite) / len(finite)):.3f} "
              f"over {len(finite)} points")
    else:
        print("# no matching ok points")
    return 0
