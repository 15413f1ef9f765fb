"""The nccl-tests style table: `#` comment lines, a header and a units row, one fixed-width row per point,
and a footer with the failures (and, where the run timed the GEMM ceiling, each record's fraction of it:
moebench.report.ceiling). The `mode` column says how a point was timed (graph, events, wall, or interp:
wall clock with the Triton kernels in the interpreter), so a CPU figure is never read as a GPU one."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from moebench.report.ceiling import ceiling_footer_lines
from moebench.run.results import timing_label

# Short column titles for the sweep parameters that commonly vary.
_PARAM_TITLES = {"num_tokens": "tokens", "padding_ratio": "pad", "top_k": "topk", "num_experts": "experts",
                 "ep_size": "ep", "padding_fill": "fill", "capacity_policy": "policy", "num_local_experts": "local",
                 "num_expert_group": "groups", "padding_producer": "producer"}
_METRICS = (("p50", "us", 10), ("p10", "us", 10), ("p90", "us", 10), ("cv", "%", 6), ("GB/s", "", 9),
            ("roof", "%", 6), ("jit", "#", 4), ("maxvio", "x", 7), ("rank_mv", "x", 7), ("mode", "", 6),
            ("status", "", 8))


def _fmt_val(v: Any, width: int) -> str:
    if isinstance(v, bool):
        s = "on" if v else "off"
    elif isinstance(v, float):
        s = f"{v:.4g}"
    elif v is None:
        s = "-"
    else:
        s = str(v)
    return s[:width].rjust(width)


class Table:
    def __init__(self, param_keys: list[str], impl_width: int = 28, out: TextIO | None = None):
        self.param_keys = param_keys
        self.impl_width = impl_width
        self.out = out or sys.stdout
        self.widths = {k: max(6, len(_PARAM_TITLES.get(k, k))) + 1 for k in param_keys}

    def _emit(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def comment(self, text: str) -> None:
        for line in text.splitlines() or [""]:
            self._emit(f"# {line}")

    def header(self) -> None:
        head = f"{'#':>5} {'impl':<{self.impl_width}}"
        units = f"{'#':>5} {'':<{self.impl_width}}"
        for k in self.param_keys:
            head += _PARAM_TITLES.get(k, k).rjust(self.widths[k])
            units += "".rjust(self.widths[k])
        for title, unit, w in _METRICS:
            head += " " + title.rjust(w)
            units += " " + f"({unit})".rjust(w) if unit else " " + "".rjust(w)
        self._emit(head)
        self._emit(units)

    def row(self, rec: dict) -> None:
        params = rec.get("params") or {}
        line = f"{rec.get('point', ''):>5} {str(rec.get('impl', ''))[:self.impl_width]:<{self.impl_width}}"
        for k in self.param_keys:
            line += _fmt_val(params.get(k), self.widths[k])
        st = rec.get("stats") or {}
        imb = rec.get("imbalance") or {}
        jit = rec.get("jit") or {}
        roof = rec.get("roof_fraction")
        vals = {
            "p50": st.get("p50"), "p10": st.get("p10"), "p90": st.get("p90"),
            "cv": None if st.get("cv") is None else 100 * st["cv"],
            "GB/s": rec.get("gbps"), "roof": None if roof is None else 100 * roof,
            "jit": jit.get("compiles") if jit.get("supported", True) else "n/a",
            # "err": the record says why there is no figure (imbalance_error)
            "maxvio": "err" if rec.get("imbalance_error") else (imb.get("expert") or {}).get("max_over_mean"),
            "rank_mv": (imb.get("rank") or {}).get("max_over_mean") if (imb.get("ep_size") or 1) > 1
            else "err" if rec.get("imbalance_error") and (params.get("ep_size") or 1) > 1 else None,
            "mode": timing_label(rec),
            "status": rec.get("status"),
        }
        for title, _, w in _METRICS:
            v = vals[title]
            if isinstance(v, float) and title in ("p50", "p10", "p90"):
                s = f"{v:.2f}" if v < 1e5 else f"{v:.4g}"
                line += " " + s.rjust(w)
            elif isinstance(v, float) and title in ("cv", "roof", "GB/s"):
                line += " " + f"{v:.1f}".rjust(w)
            elif isinstance(v, float):
                line += " " + f"{v:.2f}".rjust(w)
            else:
                line += " " + _fmt_val(v, w)
        self._emit(line)

    def footer(self, records: list[dict], restarts: int = 0) -> None:
        """The summary: points by status (and how many times a worker was restarted this run), the failures and
        the reasons for skipping."""
        counts: dict[str, int] = {}
        for r in records:
            counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
        self.comment("")
        line = "points: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "no points"
        self.comment(line + (f"; worker restarts: {restarts}" if restarts else ""))
        bad = [r for r in records if r.get("status") in ("wrong", "failed")]
        if bad:
            self.comment("failures:")
            for r in bad:
                self.comment(f"  point {r.get('point')} {r.get('impl')}: {r.get('status')}: {r.get('reason', '')}")
        skipped = {}
        for r in records:
            if r.get("status") == "skipped":
                skipped[r.get("reason", "")] = skipped.get(r.get("reason", ""), 0) + 1
        for reason, n in skipped.items():
            self.comment(f"skipped {n}: {reason}")
        for text in ceiling_footer_lines(records):  # each record's fraction of the GEMM ceiling
            self.comment(text)


def print_rows(header: list[str], rows: list[list[Any]], out: TextIO | None = None) -> None:
    """A plain table for the scripts' figures that are not sweep records: columns as wide as their widest cell,
    two spaces apart, numbers right-aligned (floats to 0.1 from 100 up, else 4 significant digits), the header as a `#` line."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(header[i]) + (2 if i == 0 else 0)] + [len(r[i]) for r in cells if i < len(r)])
              for i in range(len(header))]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows if i < len(r)) and bool(rows)
               for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    print(line(["# " + header[0], *header[1:]]), file=out or sys.stdout)
    for r in cells:
        print(line(r), file=out or sys.stdout)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return "-" if v is None else str(v)
