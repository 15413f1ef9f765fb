"""A user's serving trace as CSV: per-step token counts, one column for every DP rank alike or one per DP rank.

    # comment lines start with '#'; blank lines are skipped
    num_tokens          <- the header: `num_tokens` (one count per step, every DP rank gets it), or
    37                     `dp0,dp1,...,dp{N-1}` (one count per DP rank: N must equal the sweep's dp_size)
    512
    3

A count is a whole number of real tokens in [0, MAX_TOKENS]; 0 is an idle DP rank (it still runs the layer on
its DP padding). `trace_file:` names a file that exists (relative to the current directory, or absolute), else
one bundled with moebench (data/: `example_chat_dp2.csv`). Every problem is a TraceFileError naming the file and
the line: the sweep loader turns it into its one-line refusal (exit 2, nothing written).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent / "data"
MAX_BYTES = 1 << 20  # the same bound as a sweep file
MAX_STEPS = 100_000
MAX_TOKENS = 1 << 20
_DP_COLUMN = re.compile(r"dp(\d+)")


class TraceFileError(ValueError):
    """A trace file that cannot be used. str() is the one line shown (file, line, reason)."""


@dataclass(frozen=True)
class TraceFile:
    path: str  # as resolved (a bundled file: its path inside the package)
    sha256: str
    columns: int  # 1 (every DP rank alike) or the DP size
    tokens: tuple[tuple[int, ...], ...]  # [step][column]

    def per_rank(self, dp_size: int) -> list[list[int]]:
        """[step][dp rank] real tokens for `dp_size` DP ranks (a one-column file gives every rank its count)."""
        if self.columns == 1:
            return [[row[0]] * dp_size for row in self.tokens]
        if self.columns != dp_size:
            raise TraceFileError(f"{self.path}: {self.columns} DP columns, but dp_size is {dp_size}")
        return [list(row) for row in self.tokens]


def resolve_trace_file(name: str) -> Path:
    """The file `trace_file: name` means: an existing path, else a bundled trace of that name."""
    path = Path(name)
    if path.is_file():
        return path
    bundled = BUNDLED_DIR / name
    if "/" not in name and "\\" not in name and bundled.is_file():
        return bundled
    known = ", ".join(sorted(p.name for p in BUNDLED_DIR.glob("*.csv")))
    raise TraceFileError(f"{name}: no such file (nor a bundled trace: {known})")


def _header(cells: list[str], where: str) -> int:
    if cells == ["num_tokens"]:
        return 1
    ranks = []
    for c in cells:
        m = _DP_COLUMN.fullmatch(c)
        if not m:
            raise TraceFileError(f"{where}: header {c!r} is neither num_tokens nor dp<rank> (dp0,dp1,...)")
        ranks.append(int(m.group(1)))
    if ranks != list(range(len(ranks))):
        raise TraceFileError(f"{where}: header columns must be dp0,dp1,... in order, got {','.join(cells)}")
    return len(ranks)


def read_trace_file(name: str) -> TraceFile:
    """Parse and validate a trace file (see the module docstring)."""
    path = resolve_trace_file(name)
    data = path.read_bytes()
    if len(data) > MAX_BYTES:
        raise TraceFileError(f"{path}: {len(data):,} bytes, over the limit of {MAX_BYTES:,}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TraceFileError(f"{path}: line {line}: not UTF-8 text") from None
    columns = 0
    rows: list[tuple[int, ...]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path}: line {number}"
        cells = [c.strip() for c in stripped.split(",")]
        if not columns:
            columns = _header(cells, where)
            continue
        if len(cells) != columns:
            raise TraceFileError(f"{where}: {len(cells)} values, the header has {columns}")
        counts = []
        for c in cells:
            if not c.isdigit() or not c.isascii():
                raise TraceFileError(f"{where}: {c!r} is not a token count (a whole number >= 0)")
            if int(c) > MAX_TOKENS:
                raise TraceFileError(f"{where}: {c} tokens, over the limit of {MAX_TOKENS:,}")
            counts.append(int(c))
        rows.append(tuple(counts))
        if len(rows) > MAX_STEPS:
            raise TraceFileError(f"{where}: more than {MAX_STEPS:,} steps")
    if not columns:
        raise TraceFileError(f"{path}: line 1: no header (num_tokens, or dp0,dp1,...)")
    if not rows:
        raise TraceFileError(f"{path}: no steps after the header")
    return TraceFile(str(path), hashlib.sha256(data).hexdigest(), columns, tuple(rows))


def trace_file_problem(name: str | None, dp_size: int) -> str | None:
    """Why `trace_file: name` cannot be used with `dp_size` DP ranks, or None (the sweep loader calls this)."""
    if name is None:
        return None
    try:
        read_trace_file(name).per_rank(dp_size)
    except TraceFileError as e:
        return str(e)
    except OSError as e:
        return f"{name}: cannot read ({e.strerror})"
    return None
