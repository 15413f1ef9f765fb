"""Headline numbers of a run, declared in its sweep file and computed from the stored records only.

A sweep may carry `headlines:`, a list of specs:

    headlines:
      - label: slowest-rank excess over the mean
        metric: imbalance.rank.slowest_excess_ratio   # a dotted path into a record
        reduce: max                                   # how the selected records' values become one number
        without: {mask: false}                        # the records of the bug (a selector)
        with: {mask: true}                            # the records of the fix
        with_metric: info.other                       # optional: the `with` records' metric (default: metric)
        equal_to: {mask: false}                       # optional: `with` must equal these, pair by pair
        equal_metric: imbalance.real_only.rank.slowest_excess_ratio   # optional: their metric (default: metric)
        without_label: unmasked                       # optional column names (default: without / with)
        with_label: masked
        unit: ms                                      # optional: how the numbers read (UNITS)

A selector maps parameter names (`fixed`/`axes` keys) or record fields (`impl`, `status`, `kernel`, `variant`,
`twin_of`, `mask_aware`) to a value or a list of accepted values. `count` counts the selected records whose
metric is present (so `metric: status, reduce: count, without: {status: failed, ...}` counts failed points);
`first` and `distinct` show values that are not numbers (a failure's reason). Other reduces use the numeric
values only; with none the result is None, shown with the reason (`why`): "not in this run: no point has
capture_sizes=default (it has pow2, dense)" when the selector matches no record (a size that does not run what the
headline names), "not recorded: ..." when the selected records lack the metric (e.g. JIT compiles under the CPU
interpreter, or points that failed); one reason for the row when both sides share it. A figure the records say is
inside the timings' noise is marked `within noise` and gets no ratio; a masked/oblivious pair whose sides are not
comparable, or two sides that ran the very same trace steps, say so instead of a ratio (moebench.report.noise).

`unit` says how the values read, as the serving trace's footer writes them: `ms` (a metric in microseconds, shown
in milliseconds to 0.01) or `%` (a share, shown as a percentage to 0.1); without it a number is shown as it is.

`equal_to` pairs every `with` record with the `equal_to` record of the same impl and parameters, apart from the
keys the two selectors name, and compares metric with equal_metric exactly (==): "masked equals real-only".

`evaluate(records, specs)` gives one `HeadlineRow` per spec; `lines(rows)` formats them for the table footer and
the report. `spec_problem` validates one spec (the sweep loader calls it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from moebench.report import cells, noise

REDUCES = ("max", "min", "sum", "mean", "median", "count", "first", "distinct")
RECORD_KEYS = ("impl", "status", "kernel", "variant", "twin_of", "mask_aware")
HEADLINE_KEYS = {"label": str, "metric": str, "reduce": str, "without": dict, "with": dict, "equal_to": dict,
             "equal_metric": str, "without_label": str, "with_label": str, "with_metric": str, "unit": str}
# how a headline's numbers read: the metric's own unit -> the text the terminal and the report show
UNITS = {"ms": cells.ms, "%": cells.percent}
_REQUIRED = ("label", "metric", "reduce", "without", "with")


def spec_problem(spec: Any, param_names: Iterable[str], impls: Iterable[str]) -> str | None:
    """Why one headline spec is malformed ("key: reason"), or None. Selectors must name real parameters or
    record fields, and an `impl` they select must be one of the sweep's impls."""
    if not isinstance(spec, dict):
        return f"expected a mapping, got {type(spec).__name__}"
    for k, v in spec.items():
        if k not in HEADLINE_KEYS:
            return f"{k}: unknown key (allowed: {', '.join(HEADLINE_KEYS)})"
        if not isinstance(v, HEADLINE_KEYS[k]):
            return f"{k}: expected {HEADLINE_KEYS[k].__name__}, got {type(v).__name__}"
    for k in _REQUIRED:
        if k not in spec:
            return f"{k}: missing"
    if not spec["label"].strip():
        return "label: empty"
    for key in ("metric", "with_metric"):
        if key in spec and (not spec[key] or any(not part for part in spec[key].split("."))):
            return f"{key}: {spec[key]!r} is not a dotted path"
    if spec["reduce"] not in REDUCES:
        return f"reduce: {spec['reduce']!r} is not one of {', '.join(REDUCES)}"
    if "unit" in spec and spec["unit"] not in UNITS:
        return f"unit: {spec['unit']!r} is not one of {', '.join(UNITS)}"
    known = set(param_names) | set(RECORD_KEYS)
    impls = set(impls)
    for side in ("without", "with", "equal_to"):
        for k, v in (spec.get(side) or {}).items():
            if k not in known:
                return f"{side}.{k}: not a parameter nor one of {', '.join(RECORD_KEYS)}"
            if k == "impl":
                for name in v if isinstance(v, list) else [v]:
                    if name not in impls:
                        return f"{side}.impl: {name!r} is not an impl of this sweep"
    return None


@dataclass
class HeadlineRow:
    label: str
    without: Any
    with_: Any
    without_label: str = "without"
    with_label: str = "with"
    n_without: int = 0
    n_with: int = 0
    change: str = ""  # "12.3x" (without / with), "n/a", ...
    equal: bool | None = None  # the equal_to verdict; None when the spec has none
    equal_detail: str = ""
    spec: dict = field(default_factory=dict)
    why_without: str = ""  # why a side has no value ("not in this run: ..."); "" when it has one
    why_with: str = ""
    note_without: str = ""  # "within noise" where the records say the figure is inside the timings' spread
    note_with: str = ""
    unit: str = ""  # how the values read (UNITS); "": as they are
    model_without: str = ""  # the model's word on a figure a model made (noise.model_note), "" for a timed one
    model_with: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "without": self.without, "with": self.with_,
                "without_label": self.without_label, "with_label": self.with_label, "n_without": self.n_without,
                "n_with": self.n_with, "change": self.change, "equal": self.equal, "equal_detail": self.equal_detail,
                "why_without": self.why_without, "why_with": self.why_with, "note_without": self.note_without,
                "note_with": self.note_with, "unit": self.unit, "model_without": self.model_without,
                "model_with": self.model_with}


_MISSING = object()


def metric_value(record: dict, path: str) -> Any:
    """The value at a dotted path of a record (None when any part is missing)."""
    node: Any = record
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _field(record: dict, key: str) -> Any:
    if key in RECORD_KEYS:
        return record.get(key, _MISSING)
    return (record.get("params") or {}).get(key, _MISSING)


def matches(record: dict, selector: dict) -> bool:
    for k, want in selector.items():
        got = _field(record, k)
        if got is _MISSING:
            return False
        if isinstance(want, list) and not isinstance(got, list):
            if got not in want:
                return False
        elif got != want:
            return False
    return True


def select(records: Iterable[dict], selector: dict) -> list[dict]:
    return [r for r in records if matches(r, selector)]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def reduce_values(values: list[Any], how: str) -> Any:
    present = [v for v in values if v is not None]
    if how == "count":
        return len(present)
    if how == "first":
        return present[0] if present else None
    if how == "distinct":
        out: list[Any] = []
        for v in present:
            if v not in out:
                out.append(v)
        return out
    nums = [v for v in present if _is_number(v)] + [int(v) for v in present if isinstance(v, bool)]
    if not nums:
        return None
    if how == "max":
        return max(nums)
    if how == "min":
        return min(nums)
    if how == "sum":
        return sum(nums)
    if how == "mean":
        return sum(nums) / len(nums)
    if how == "median":
        return statistics.median(nums)
    raise ValueError(f"unknown reduce {how!r} (one of {', '.join(REDUCES)})")


def _change(without: Any, with_: Any) -> str:
    if not (_is_number(without) and _is_number(with_)):
        return "n/a" if without is None or with_ is None else ""
    if with_ == 0:
        return "equal (both 0)" if without == 0 else "to 0"
    ratio = without / with_
    return f"{ratio:.3g}x"


def _pair_key(record: dict, ignore: set[str]) -> str:
    params = {k: v for k, v in (record.get("params") or {}).items() if k not in ignore}
    impl = None if "impl" in ignore else record.get("impl")
    return repr((impl, sorted(params.items())))


def _equality(records: list[dict], spec: dict) -> tuple[bool, str]:
    with_sel, eq_sel = spec["with"], spec["equal_to"]
    ignore = set(with_sel) | set(eq_sel)
    eq_metric = spec.get("equal_metric", spec["metric"])
    others = {}
    for r in select(records, eq_sel):
        others.setdefault(_pair_key(r, ignore), r)
    pairs = differ = unpaired = 0
    first_diff = ""
    for r in select(records, with_sel):
        other = others.get(_pair_key(r, ignore))
        if other is None:
            unpaired += 1
            continue
        pairs += 1
        a, b = metric_value(r, spec["metric"]), metric_value(other, eq_metric)
        if a is None or a != b:
            differ += 1
            if not first_diff:
                first_diff = f"; first at point {r.get('point')}: {format_value(a)} != {format_value(b)}"
    if pairs == 0:
        return False, "no pairs to compare"
    tail = f", {unpaired} unpaired" if unpaired else ""
    if differ:
        return False, f"differs in {differ} of {pairs} pairs{tail}{first_diff}"
    return True, f"equal in {pairs} of {pairs} pairs{tail}"


def _selector_text(key: str, want: Any) -> str:
    return f"{key} in [{', '.join(map(str, want))}]" if isinstance(want, list) else f"{key}={want}"


def why_missing(records: list[dict], selector: dict, chosen: list[dict], metric: str) -> str:
    """Why a side selecting `chosen` (by `selector`) out of `records` has no value of `metric`, in one phrase."""
    if not chosen:
        for key, want in selector.items():
            if not any(matches(r, {key: want}) for r in records):
                seen = []
                for r in records:
                    got = _field(r, key)
                    if got is not _MISSING and str(got) not in seen:
                        seen.append(str(got))
                has = f" (it has {', '.join(seen[:6])}{', ...' if len(seen) > 6 else ''})" if seen else ""
                return f"not in this run: no point has {_selector_text(key, want)}{has}"
        together = ", ".join(_selector_text(k, v) for k, v in selector.items())
        return f"not in this run: no point has {together} together"
    statuses = sorted({str(r.get("status")) for r in chosen})
    if "ok" not in statuses:
        return f"not recorded: the {len(chosen)} selected point(s) are {'/'.join(statuses)}"
    return f"not recorded: {metric} is in none of the {len(chosen)} selected point(s)"


def evaluate(records: list[dict], specs: list[dict]) -> list[HeadlineRow]:
    """One row per spec, from the records alone."""
    rows = []
    for spec in specs:
        sides, counts, why, note, chosen, paired, model = {}, {}, {}, {}, {}, "", {}
        for side in ("without", "with"):
            chosen[side] = select(records, spec[side])
            counts[side] = len(chosen[side])
            # with_metric: both sides read from the same records (a serving_trace record holds masked and oblivious)
            metric = spec.get("with_metric", spec["metric"]) if side == "with" else spec["metric"]
            sides[side] = reduce_values([metric_value(r, metric) for r in chosen[side]], spec["reduce"])
            why[side] = "" if sides[side] is not None else why_missing(records, spec[side], chosen[side], metric)
            note[side] = noise.metric_note(chosen[side], metric) if sides[side] is not None else ""
            model[side] = noise.model_note(chosen[side], metric) if sides[side] is not None else ""
            paired = paired or noise.pair_note(chosen[side], spec["metric"], spec.get("with_metric", spec["metric"]))
        change = _change(sides["without"], sides["with"])
        if change and change != "n/a":  # a ratio the records cannot support is not printed as one
            if spec["without"] != spec["with"] and noise.same_steps(chosen["without"], chosen["with"]):
                change = "no comparison: both sides ran the same trace steps at this size"
            elif paired:
                change = paired
            elif note["without"] or note["with"]:
                change = "within noise"
        row = HeadlineRow(label=spec["label"], without=sides["without"], with_=sides["with"],
                          without_label=spec.get("without_label", "without"),
                          with_label=spec.get("with_label", "with"), n_without=counts["without"],
                          n_with=counts["with"], change=change, spec=dict(spec),
                          why_without=why["without"], why_with=why["with"], note_without=note["without"],
                          note_with=note["with"], unit=spec.get("unit", ""), model_without=model["without"],
                          model_with=model["with"])
        if "equal_to" in spec:
            row.equal, row.equal_detail = _equality(records, spec)
        rows.append(row)
    return rows


def format_value(v: Any, unit: str = "") -> str:
    """A headline value as text: a number in its `unit` (UNITS) where it has one."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if unit and _is_number(v):
        return UNITS[unit](v)
    if isinstance(v, float):
        return cells.plain(v)  # 4 significant digits, never in scientific notation
    if isinstance(v, list):
        s = ", ".join(format_value(x) for x in v[:4]) + (", ..." if len(v) > 4 else "")
        return f"[{s}]"
    s = str(v)
    return s if len(s) <= 120 else s[:117] + "..."


def side_text(value: Any, why: str, note: str = "", unit: str = "", model: str = "") -> str:
    """A side's value in its unit (with `within noise` where it is, and the model's word where a model made it),
    or n/a with the reason it has none."""
    if value is None and why:
        return f"n/a ({why})"
    said = "; ".join(w for w in (model, note) if w)
    return format_value(value, unit) + (f" ({said})" if said else "")


def line(row: HeadlineRow) -> str:
    """`label: without-label A | with-label B (change); equality` on one line; `label: reason` when neither side
    has a value for the same reason."""
    if row.without is None and row.with_ is None and row.why_without and row.why_without == row.why_with:
        return f"{row.label}: {row.why_without}"
    text = (f"{row.label}: {row.without_label} "
            f"{side_text(row.without, row.why_without, row.note_without, row.unit, row.model_without)}"
            f" | {row.with_label} {side_text(row.with_, row.why_with, row.note_with, row.unit, row.model_with)}")
    said = row.change == "within noise" and (row.note_without or row.note_with)  # already after the values
    if row.change and row.change != "n/a" and not said:
        text += f" ({row.change})"
    if row.equal is not None:
        text += f"; {'EQUAL' if row.equal else 'NOT EQUAL'} to the reference: {row.equal_detail}"
    return text


def lines(rows: list[HeadlineRow]) -> list[str]:
    return [line(r) for r in rows]


def footer_lines(records: list[dict], specs: list[dict]) -> list[str]:
    """The `headline:` lines the runner prints under its table (none without specs)."""
    if not specs:
        return []
    return ["headlines (without the fix | with it):"] + [f"  {text}" for text in lines(evaluate(records, specs))]
