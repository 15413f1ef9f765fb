"""Each record against the GEMM ceiling measured in the same run at the same point (nothing is re-run).

A ceiling record is one of an impl registered with `ceiling=True` (bench.experts_ceiling: torch's two expert GEMMs
alone); its info says which expert dtype it is the ceiling of (`expert_dtype`) and on which groups (`groups`:
"routed", the point's own group sizes, or "equal"). Every other ok record whose info names the same expert dtype,
at the same point (report.peers.point_of: kernel family + every parameter), gets:
  ceiling_us           the own-routing ceiling's p50
  ceiling_equal_us     the equal-group ceiling's p50 (None when the run has none)
  uneven_cost          ceiling_us / ceiling_equal_us: what uneven expert sizes cost the GEMMs alone
  fraction_of_ceiling  ceiling_us / the record's p50 (1: as fast as the two GEMMs alone; above 1: faster)
  experts_stage_fraction  ceiling_us / the p50 of the record's experts stage, where it has one (the layer)
Used by the table's "vs the GEMM ceiling" footer and the report page.
"""

from __future__ import annotations

from moebench.report import cells
from moebench.report.peers import p50_of, point_of

__all__ = ["ceiling_rows", "ceiling_footer_lines"]


def _dtype(rec: dict) -> str | None:
    return (rec.get("info") or {}).get("expert_dtype")


def ceiling_rows(records: list[dict]) -> list[dict]:
    """One row per ok non-ceiling record with an own-routing ceiling at its point: point, impl, params, p50,
    ceiling_us, ceiling_equal_us, uneven_cost, fraction_of_ceiling, experts_stage_fraction. In record order."""
    ceilings: dict[tuple, float] = {}
    for r in records:
        p50 = p50_of(r)
        if r.get("ceiling") and p50 is not None:
            ceilings[(point_of(r), _dtype(r), (r.get("info") or {}).get("groups"))] = p50
    rows = []
    for r in records:
        p50 = p50_of(r)
        if r.get("ceiling") or p50 is None or _dtype(r) is None:
            continue
        at = (point_of(r), _dtype(r))
        ceiling = ceilings.get((*at, "routed"))
        if ceiling is None:
            continue
        equal = ceilings.get((*at, "equal"))
        stage = ((r.get("stages") or {}).get("experts") or {}).get("p50")  # the layer times its experts alone too
        rows.append({"point": r.get("point"), "impl": r.get("impl"), "params": r.get("params") or {}, "p50": p50,
                     "expert_dtype": _dtype(r), "ceiling_us": ceiling, "ceiling_equal_us": equal,
                     "uneven_cost": ceiling / equal if equal else None, "fraction_of_ceiling": ceiling / p50,
                     "experts_stage_fraction": ceiling / stage if isinstance(stage, (int, float)) and stage > 0
                     else None})
    return rows


def _varying(rows: list[dict]) -> list[str]:
    values: dict[str, set] = {}
    for r in rows:
        for k, v in r["params"].items():
            values.setdefault(k, set()).add(repr(v))
    return [k for k, vals in values.items() if len(vals) > 1]


def ceiling_footer_lines(records: list[dict]) -> list[str]:
    """The "vs the GEMM ceiling" block under the table (empty when the run timed no ceiling)."""
    rows = ceiling_rows(records)
    if not rows:
        return []
    keys = _varying(rows)

    table = [[str(r["point"]), str(r["impl"]), cells.us(r["p50"]), cells.us(r["ceiling_us"]),
              cells.ratio(r["fraction_of_ceiling"]), cells.us(r["ceiling_equal_us"]), cells.ratio(r["uneven_cost"]),
              " ".join(f"{k}={r['params'].get(k)}" for k in keys)] for r in rows]
    return ["", "vs the GEMM ceiling: torch's two expert GEMMs alone at the same point, same expert dtype; "
                "fraction = ceiling / p50 (1: as fast as the GEMMs alone), uneven = ceiling / equal-group ceiling",
            *cells.columns(["point", "impl", "p50 us", "ceiling us", "fraction", "equal us", "uneven", "params"],
                           table, head_prefix="  ", right=[True, False, True, True, True, True, True, False])]
