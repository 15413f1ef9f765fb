"""The nccl-tests style table: `#` comment lines, a header and a units row, one row per point, and a footer with
the failures (and, where the run timed the GEMM ceiling, each record's fraction of it: moebench.report.ceiling).
The `mode` column says how a point was timed (graph, events, wall, or interp: wall clock with the Triton kernels in
the interpreter), so a CPU figure is never read as a GPU one.

The columns (METRICS), the footer (footer_lines) and the statement of how a run was timed (timing_statement) are
shared with the report page, so both say the same thing in the same words and numbers (moebench.report.cells)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TextIO

from moebench.report import cells
from moebench.report.ceiling import ceiling_footer_lines
from moebench.records import timing_label

# Short column titles for the sweep parameters that commonly vary.
_PARAM_TITLES = {"num_tokens": "tokens", "padding_ratio": "pad", "top_k": "topk", "num_experts": "experts",
                 "ep_size": "ep", "padding_fill": "fill", "capacity_policy": "policy", "num_local_experts": "local",
                 "num_expert_group": "groups", "padding_producer": "producer"}
DEFAULT_IMPL_WIDTH = 28  # the impl column when the points are not known up front
# What p50 / p10 / p90 time for targets whose timed call is not one kernel call (the header says it)
TIMED_CALL = {
    "serving_trace": "the masked layer at the trace's most frequent call shape (the trace's figures are under the "
                     "table)",
    "jit_trace": "one replay of the last step's pack + combine, already compiled (the compiles are the jit column)",
}


def timed_call_line(target: str | None) -> str | None:
    """The line above the table header saying what the p50 column times, for a target where it is not a kernel
    call; None for the others."""
    what = TIMED_CALL.get(target or "")
    return f"p50 / p10 / p90: {what}" if what else None


@dataclass(frozen=True)
class Metric:
    """One measured column: title, unit, width while rows stream (a wider value widens its row, nothing is cut),
    the value read from a record and how it is written."""
    title: str
    unit: str
    width: int
    value: Callable[[dict], Any]
    text: Callable[[Any], str]


def _stat(name: str) -> Callable[[dict], Any]:
    return lambda rec: (rec.get("stats") or {}).get(name)


def _jit(rec: dict) -> Any:
    jit = rec.get("jit") or {}
    return jit.get("compiles") if jit.get("supported", True) else "n/a"


def _maxvio(rec: dict) -> Any:
    if rec.get("imbalance_error"):  # the record says why there is no figure
        return "err"
    return ((rec.get("imbalance") or {}).get("expert") or {}).get("max_over_mean")


def _rank_mv(rec: dict) -> Any:
    imb = rec.get("imbalance") or {}
    if (imb.get("ep_size") or 1) > 1:
        return (imb.get("rank") or {}).get("max_over_mean")
    return "err" if rec.get("imbalance_error") and ((rec.get("params") or {}).get("ep_size") or 1) > 1 else None


METRICS: tuple[Metric, ...] = (
    Metric("p50", "us", 10, _stat("p50"), cells.us), Metric("p10", "us", 10, _stat("p10"), cells.us),
    Metric("p90", "us", 10, _stat("p90"), cells.us), Metric("cv", "%", 6, _stat("cv"), cells.pct),
    Metric("GB/s", "", 9, lambda r: r.get("gbps"), cells.gbps),
    Metric("roof", "%", 6, lambda r: r.get("roof_fraction"), cells.pct),
    Metric("jit", "#", 4, _jit, cells.plain),
    Metric("maxvio", "x", 7, _maxvio, cells.times),  # expert load max/mean (records: imbalance.expert.max_over_mean)
    Metric("rank_mv", "x", 7, _rank_mv, cells.times),  # EP rank load max/mean, multi-rank points only
    Metric("mode", "", 6, timing_label, cells.plain),
    Metric("status", "", 8, lambda r: r.get("status"), cells.plain),
)


def metric_title(m: Metric) -> str:
    """`p50 (us)`: the title with its unit, as the report page heads a column."""
    return f"{m.title} ({m.unit})" if m.unit and m.unit != "#" else m.title


def param_cell(v: Any) -> str:
    return cells.plain(v)


class Table:
    """Rows print as points finish, so the columns are sized up front: the parameter and impl columns from the
    points to be run (`points`: objects with .impl and .params), the measured ones by METRICS; a value wider than
    its column widens its row and is never cut."""

    def __init__(self, param_keys: list[str], impl_width: int | None = None, out: TextIO | None = None,
                 points: Iterable[Any] | None = None, target: str | None = None):
        self.param_keys = param_keys
        self.target = target
        self.out = out or sys.stdout
        seen: dict[str, set[str]] = {k: set() for k in param_keys}
        impls: set[str] = set()
        for pt in points or ():
            impls.add(str(pt.impl))
            flat = pt.params if isinstance(pt.params, dict) else pt.params.to_dict()  # a family's keys too
            for k in param_keys:
                seen[k].add(param_cell(flat.get(k)))
        self.impl_width = impl_width or max([len(i) for i in impls] or [DEFAULT_IMPL_WIDTH])
        self.widths = {k: max([6, len(_PARAM_TITLES.get(k, k))] + [len(v) for v in seen[k]]) + 1
                       for k in param_keys}

    def _emit(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def comment(self, text: str) -> None:
        for line in text.splitlines() or [""]:
            self._emit(f"# {line}")

    def header(self) -> None:
        timed = timed_call_line(self.target)
        if timed:
            self.comment(timed)
        head = f"{'#':>5} {'impl':<{self.impl_width}}"
        units = f"{'#':>5} {'':<{self.impl_width}}"
        for k in self.param_keys:
            head += _PARAM_TITLES.get(k, k).rjust(self.widths[k])
            units += "".rjust(self.widths[k])
        for m in METRICS:
            head += " " + m.title.rjust(m.width)
            units += " " + (f"({m.unit})".rjust(m.width) if m.unit else "".rjust(m.width))
        self._emit(head)
        self._emit(units.rstrip())

    def row(self, rec: dict) -> None:
        params = rec.get("params") or {}
        line = f"{rec.get('point', ''):>5} {str(rec.get('impl', '')):<{self.impl_width}}"
        for k in self.param_keys:
            line += " " + param_cell(params.get(k)).rjust(self.widths[k] - 1)
        for m in METRICS:
            line += " " + m.text(m.value(rec)).rjust(m.width)
        self._emit(line)

    def footer(self, records: list[dict], restarts: int = 0) -> None:
        """The summary under the table (footer_lines)."""
        for text in footer_lines(records, restarts):
            self.comment(text)


def footer_lines(records: list[dict], restarts: int = 0) -> list[str]:
    """What stdout prints under the table: status_lines, what a column's n/a means (column_notes), then each
    record's fraction of the GEMM ceiling (where the run timed one)."""
    return ["", *status_lines(records, restarts), *column_notes(records), *ceiling_footer_lines(records)]


def column_notes(records: list[dict]) -> list[str]:
    """Why a column says n/a, where one does: the jit column's n/a is a point whose compiles could not be counted
    (the interpreter compiles nothing), with the reason its record gives; one line per reason."""
    reasons: dict[str, int] = {}
    for r in records:
        jit = r.get("jit") or {}
        if jit and not jit.get("supported", True):
            reason = str(jit.get("reason") or "the record does not say why")
            reasons[reason] = reasons.get(reason, 0) + 1
    every = len(reasons) == 1 and sum(reasons.values()) == len(records)
    lines = []
    for reason, n in reasons.items():
        which = "" if every else f" ({n} point{'s' if n > 1 else ''})"
        lines.append(f"jit n/a{which}: Triton JIT compiles not counted: {reason}")
    return lines


def status_lines(records: list[dict], restarts: int = 0) -> list[str]:
    """The points by status (and how many times a worker was restarted this run), the failures and the reasons
    for skipping."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    line = "points: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "no points"
    out = [line + (f"; worker restarts: {restarts}" if restarts else "")]
    bad = [r for r in records if r.get("status") in ("wrong", "failed")]
    if bad:
        out.append("failures:")
        out += [f"  point {r.get('point')} {r.get('impl')}: {r.get('status')}: {r.get('reason', '')}" for r in bad]
    skipped: dict[str, int] = {}
    for r in records:
        if r.get("status") == "skipped":
            skipped[r.get("reason", "")] = skipped.get(r.get("reason", ""), 0) + 1
    return out + [f"skipped {n}: {reason}" for reason, n in skipped.items()]


_MODE_TEXT = {
    "interp": "Triton interpreter on CPU: timings are not GPU figures (host wall clock, Triton kernels interpreted)",
    "graph": "CUDA-graph replay",
    "events": "CUDA events",
}


def timing_statement(records: list[dict], manifest: dict) -> tuple[str, bool]:
    """(how the run's points were timed, in one line; whether its timings are GPU figures). One clause per timing
    mode of the ok records (with their count when the run mixes modes)."""
    env = manifest.get("env") or {}
    gpu = env.get("gpu")
    modes: dict[str, int] = {}
    for r in records:
        label = timing_label(r)
        if label and r.get("status") == "ok":
            modes[label] = modes.get(label, 0) + 1
    if not modes:
        return "no point was timed", True
    clauses = []
    for label, n in modes.items():
        if label == "wall":
            on_cpu = not any(str(r.get("device") or manifest.get("device") or "").startswith("cuda")
                             for r in records if timing_label(r) == "wall")
            text = ("host wall clock on the CPU: timings are not GPU figures" if on_cpu
                    else "host wall clock around each call" + (f" on {gpu}" if gpu else ""))
        else:
            text = _MODE_TEXT.get(label, label) + (f" on {gpu}" if gpu and label in ("graph", "events") else "")
        clauses.append(f"{text} ({n} point{'s' if n != 1 else ''})" if len(modes) > 1 else text)
    gpu_figures = all(label in ("graph", "events") for label in modes)
    return "timing: " + "; ".join(clauses), gpu_figures


def print_rows(header: list[str], rows: list[list[Any]], out: TextIO | None = None) -> None:
    """A plain table for the scripts' figures that are not sweep records: columns as wide as their widest cell,
    two spaces apart, numbers right-aligned (floats to 0.1 from 100 up, else 4 significant digits, never in
    scientific notation), the header as a `#` line."""
    text = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(header[i]) + (2 if i == 0 else 0)] + [len(r[i]) for r in text if i < len(r)])
              for i in range(len(header))]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows if i < len(r)) and bool(rows)
               for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    print(line(["# " + header[0], *header[1:]]), file=out or sys.stdout)
    for r in text:
        print(line(r), file=out or sys.stdout)


def _cell(v: Any) -> str:
    if isinstance(v, float) and v == v and abs(v) >= 100:
        return cells.fixed(v, 1)
    return cells.plain(v) if not isinstance(v, bool) else str(v)
