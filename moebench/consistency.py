"""The consistency pass over a record before it is written: totals equal their parts, signs as the definitions allow.

Checks are registered per target (`register_check(target)`; `"*"` for every record), so each family owns the checks
of its own figures (moebench.bench.serving_trace.checks for serving_trace); this module holds the registry, the checks of
the statistics every timed record has, and `vet(record)`, which the runner calls where a record is appended. A check
is `fn(record) -> iterable of "figure: what is wrong"`, the figure named by its dotted path in the record. Checks
are identities and definitional signs only, never a judgement of noise: a figure that is the difference of two
timings may be negative (that is the timings' noise, said elsewhere), a total that is not the sum of its parts
cannot be.

A failure makes an `ok` point `wrong`, with `reason: "inconsistent figures: <first problem>"` and every problem in
`consistency`. Why not a recorded warning: every figure of such a record was derived by the same code that broke an
identity, so none of them can be trusted, and a warning would leave the point in the headlines, `compare`, the
report and the geometric means, where nobody reads a warning; `wrong` takes it out of all of them (they read `ok`
points only), prints it in the table and makes the run exit 1, as a kernel that disagrees with its reference does.
A check that itself raises is a problem of that check, named, not a crash of the run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

__all__ = ["register_check", "checks_for", "problems", "vet", "close", "value_at"]

Check = Callable[[dict], Iterable[str]]
_CHECKS: dict[str, list[Check]] = {}


def register_check(target: str) -> Callable[[Check], Check]:
    """Decorator: run `fn` on every record of `target` ("*": every record) before it is written."""
    def add(fn: Check) -> Check:
        _CHECKS.setdefault(target, []).append(fn)
        return fn
    return add


def checks_for(target: str | None) -> list[Check]:
    return list(_CHECKS.get("*", [])) + (list(_CHECKS.get(target, [])) if target else [])


def value_at(record: dict, path: str) -> Any:
    """The value at a dotted path (None when a part is missing)."""
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def close(total: float, parts: float, *, terms: int = 2) -> bool:
    """Equal up to the stored rounding: records keep times to 0.001 us, so each term may be off by half of that;
    and 1e-9 relative for sums over many steps."""
    return abs(total - parts) <= 0.0006 * (terms + 1) + 1e-9 * max(abs(total), abs(parts))


def problems(record: dict) -> list[str]:
    """Every "figure: what is wrong" of an ok record (none for one that is not ok: it has no figures to trust)."""
    if record.get("status") != "ok":
        return []
    out: list[str] = []
    for check in checks_for(record.get("target")):
        try:
            out.extend(check(record))
        except Exception as e:  # a broken check is named, the run goes on
            out.append(f"check {getattr(check, '__name__', check)}: raised {type(e).__name__}: {e}")
    return out


def vet(record: dict) -> dict:
    """The record, an ok one made `wrong` naming its first inconsistent figure when it has any (all of them in
    `consistency`)."""
    found = problems(record)
    if found:
        record["consistency"] = found
        more = f" (and {len(found) - 1} more in `consistency`)" if len(found) > 1 else ""
        record.update(status="wrong", reason=f"inconsistent figures: {found[0]}{more}")
    return record


@register_check("*")
def stats_in_order(record: dict) -> Iterable[str]:
    """A timed record's statistics: min <= p10 <= p50 <= p90 <= max, cv >= 0, every one a finite number."""
    stats = record.get("stats")
    if not isinstance(stats, dict) or not stats:
        return
    order = [k for k in ("min", "p10", "p50", "p90", "max") if _number(stats.get(k))]
    for lo, hi in zip(order, order[1:]):
        if stats[lo] > stats[hi] * (1 + 1e-9) + 1e-9:
            yield f"stats.{lo}: {stats[lo]} above stats.{hi} {stats[hi]}"
    if _number(stats.get("min")) and stats["min"] < 0:
        yield f"stats.min: {stats['min']} us is negative"
    if _number(stats.get("cv")) and stats["cv"] < 0:
        yield f"stats.cv: {stats['cv']} is negative"
