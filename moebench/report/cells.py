"""How a value becomes a table cell, and how a table's columns are sized: one place for stdout's run table, the
report page, `moebench compare` and `moebench tune`, so a figure reads the same wherever it is printed.

Measurements are fixed-point with the unit in the column title, never in scientific notation: microseconds to
0.01 (`44877.64`, `376200.12`), percentages to 0.1, ratios to 0.001, max/mean imbalance to 0.01, GB/s to 0.1.
A missing value (None, NaN) is `-`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

MISSING = "-"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fixed(v: Any, decimals: int) -> str:
    """A number to `decimals` places (ints as they are); `-` when missing or not finite; other values as text."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return MISSING
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{decimals}f}"


def us(v: Any) -> str:
    """Microseconds (latency)."""
    return fixed(v, 2)


def pct(fraction: Any) -> str:
    """A fraction shown as a percentage (0.156 -> 15.6)."""
    return fixed(100 * fraction if _finite(fraction) else fraction, 1)


def ms(microseconds: Any) -> str:
    """Microseconds as milliseconds with the unit (a headline's `unit: ms`, as the serving trace's footer writes
    them): 973755.1 -> `973.76 ms`."""
    if not _finite(microseconds):
        return fixed(microseconds, 2)
    return f"{round(microseconds / 1e3, 2) + 0.0:.2f} ms"  # + 0.0: no "-0.00"


def percent(fraction: Any) -> str:
    """A fraction as a percentage with the sign (a headline's `unit: %`): 0.02988 -> `3.0%`."""
    if not _finite(fraction):
        return fixed(fraction, 1)
    return f"{round(100 * fraction, 1) + 0.0:.1f}%"


def ratio(v: Any) -> str:
    """A ratio of two times (B/A, of ceiling, vs best peer)."""
    return fixed(v, 3)


def times(v: Any) -> str:
    """A max/mean imbalance (maxvio, rank_mv)."""
    return fixed(v, 2)


def gbps(v: Any) -> str:
    return fixed(v, 1)


def plain(v: Any, digits: int = 4) -> str:
    """A value of no declared unit (a parameter, a headline number): ints as they are, floats to `digits`
    significant digits but never in scientific notation (69750.3 -> 69750, 0.35 -> 0.35, 2.5 -> 2.5)."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if not isinstance(v, float):
        return MISSING if v is None else str(v)
    if not math.isfinite(v):
        return MISSING if math.isnan(v) else str(v)
    if v == int(v):
        return f"{v:.0f}"
    decimals = min(max(digits - 1 - math.floor(math.log10(abs(v))), 0), 9)
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def is_number(text: str) -> bool:
    """A cell that reads as a number (right-aligned)."""
    try:
        float(text)
        return text.strip() not in ("nan", "inf", "-inf")
    except ValueError:
        return False


def columns(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None,
            head_prefix: str = "# ", row_prefix: str = "  ", gap: int = 2) -> list[str]:
    """Text lines of a table whose columns are as wide as their widest cell (nothing is cut): the header line
    starts with `head_prefix`, each row with `row_prefix` (same width). `right`: which columns are right-aligned
    (default: those whose cells all read as numbers or `-`)."""
    ncol = len(header)
    cells = [[str(c) for c in r] + [""] * (ncol - len(r)) for r in rows]
    if right is None:
        right = [bool(cells) and all(is_number(r[i]) or r[i] == MISSING for r in cells) for i in range(ncol)]
    widths = [max([len(header[i])] + [len(r[i]) for r in cells]) for i in range(ncol)]
    pad = " " * gap

    def line(prefix: str, values: Sequence[str]) -> str:
        return prefix + pad.join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right))

    return [line(head_prefix, header).rstrip()] + [line(row_prefix, r).rstrip() for r in cells]
