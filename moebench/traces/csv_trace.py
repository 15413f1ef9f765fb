"""A user's serving trace as CSV: per-step token counts, one column for every DP rank alike or one per DP rank.

    # comment lines start with '#'; blank lines are skipped
    num_tokens          <- the header: `num_tokens` (one count per step, every DP rank gets it), or
    37                     `dp0,dp1,...,dp{N-1}` (one count per DP rank: N must equal the sweep's dp_size)
    512
    3

The count columns are found by name, in any order; other columns (an engine's export has `step`, `timestamp`...)
are skipped unread and named in the run's header (TraceFile.ignored_columns). A UTF-8 byte order mark (a
spreadsheet's "CSV UTF-8") is skipped. A count is a whole number of real tokens in [0, MAX_TOKENS]; 0 is an idle
DP rank (it still runs the layer on its DP padding). A sweep's `trace_file:` is resolved by the sweep loader
(beside the sweep, the current directory, then the files bundled in data/, e.g. `example_chat_dp2.csv`:
docs/sweeps.md#paths-in-a-sweep) and reaches this module as an absolute path. Every problem is a TraceFileError
naming the file and the line: the sweep loader turns it into its one-line refusal (exit 2, nothing written). The
file is streamed (no byte limit); the bound is on the token table it makes (MAX_COUNTS), and the distinct steps
come from moebench.traces.distinct.
"""

from __future__ import annotations

import csv
import hashlib
import re
from array import array
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from moebench.traces.distinct import DistinctSteps, distinct_steps

BUNDLED_DIR = Path(__file__).resolve().parent / "data"
# The token table is held as int32 [steps, columns]; a file whose table would pass 1 GiB is refused at the line
# that passes it. A fixed bound rather than a share of the free memory: a sweep that validates on one machine
# validates on every machine, and a resume never meets another limit than its run. 2^28 counts: 268 million
# one-column steps, 33 million steps of 8 DP ranks (a busy server's day is a few million).
MAX_COUNTS = 1 << 28
MAX_TOKENS = 1 << 20
_DP_COLUMN = re.compile(r"dp(0|[1-9][0-9]*)")
_BOM = b"\xef\xbb\xbf"
_COUNTS_LINE = re.compile(rb"[ \t]*[0-9]+(?:[ \t]*,[ \t]*[0-9]+)*[ \t]*\r?\n?")  # a data line, checked in one match


class TraceFileError(ValueError):
    """A trace file that cannot be used. str() is the one line shown (file, line, reason)."""


@dataclass(frozen=True, eq=False)
class TraceFile:
    path: str  # as resolved (a bundled file: its path inside the package)
    sha256: str
    columns: int  # 1 (every DP rank alike) or the DP size
    table: np.ndarray  # int32 [steps, columns], read-only
    ignored_columns: tuple[str, ...] = ()  # the header's columns that are no counts, skipped unread
    per_dp_rank: bool = False  # the header names its columns dp0, dp1, ...: one per DP rank, never shared
    _distinct: dict = field(default_factory=dict, repr=False)  # dp_size -> DistinctSteps, computed once

    @property
    def num_steps(self) -> int:
        return int(self.table.shape[0])

    @property
    def tokens(self) -> tuple[tuple[int, ...], ...]:
        """[step][column] as Python tuples (one object per step: for small traces; `table` is the array)."""
        return tuple(map(tuple, self.table.tolist()))

    def check_dp_size(self, dp_size: int) -> None:
        """TraceFileError unless the file's columns fit `dp_size` DP ranks (a num_tokens column fits any; dp0,
        dp1, ... columns name their ranks, so they must be all of them)."""
        if (self.columns != 1 or self.per_dp_rank) and self.columns != dp_size:
            names = ",".join(f"dp{r}" for r in range(self.columns)) if self.per_dp_rank else f"{self.columns}"
            raise TraceFileError(f"{self.path}: {names} DP column{'s' if self.columns > 1 else ''}, but dp_size is "
                                 f"{dp_size} (one num_tokens column gives every DP rank its counts)")

    def per_rank(self, dp_size: int) -> list[list[int]]:
        """[step][dp rank] real tokens for `dp_size` DP ranks (a one-column file gives every rank its count)."""
        self.check_dp_size(dp_size)
        if self.columns == 1:
            return np.repeat(self.table, dp_size, axis=1).tolist()
        return self.table.tolist()

    def distinct_steps(self, dp_size: int) -> DistinctSteps:
        """The distinct per-DP-rank steps of per_rank(dp_size), their counts and each step's index into them
        (moebench.traces.distinct), without a Python object per step. Computed once per dp_size (a file read
        before comes from read_trace_file's cache, so the points of a run share it); its arrays are read-only."""
        self.check_dp_size(dp_size)
        if dp_size not in self._distinct:
            found = distinct_steps(self.table)
            if self.columns == 1 and dp_size != 1:
                found = DistinctSteps(tuple(step * dp_size for step in found.steps), found.counts, found.index)
            found.counts.flags.writeable = False
            found.index.flags.writeable = False
            self._distinct[dp_size] = found
        return self._distinct[dp_size]


def resolve_trace_file(name: str) -> Path:
    """The file `trace_file: name` means outside a sweep: an existing path, else a bundled trace of that name. (A
    sweep's trace_file is resolved by the sweep loader first: moebench.run.paths.resolve_sweep_path.)"""
    path = Path(name)
    if path.is_file():
        return path
    bundled = BUNDLED_DIR / name
    if "/" not in name and "\\" not in name and bundled.is_file():
        return bundled
    known = ", ".join(sorted(p.name for p in BUNDLED_DIR.glob("*.csv")))
    raise TraceFileError(f"{name}: no such file (nor a bundled trace: {known})")


@dataclass(frozen=True)
class _Header:
    width: int  # cells a data line has
    counts: tuple[int, ...]  # the cell index of each count column: num_tokens, or dp0, dp1, ... in rank order
    ignored: tuple[str, ...]  # the names of the other cells
    per_dp_rank: bool = False  # the counts are dp<rank> columns (not num_tokens)

    @property
    def plain(self) -> bool:
        """Only the count columns, in rank order: the data lines are read whole (the fast path)."""
        return self.counts == tuple(range(self.width))


def _header(cells: list[str], where: str) -> _Header:
    """The count columns of the header `cells`, by name; every other column is ignored."""
    ranks: dict[int, int] = {}  # DP rank -> cell index
    num_tokens, ignored = [], []
    for i, c in enumerate(cells):
        m = _DP_COLUMN.fullmatch(c)
        if m:
            if int(m.group(1)) in ranks:
                raise TraceFileError(f"{where}: header names {c} twice")
            ranks[int(m.group(1))] = i
        elif c == "num_tokens":
            if num_tokens:
                raise TraceFileError(f"{where}: header names num_tokens twice")
            num_tokens.append(i)
        else:
            ignored.append(c)
    if num_tokens and ranks:
        raise TraceFileError(f"{where}: header has both num_tokens and dp<rank> columns (give one or the other)")
    if not num_tokens and not ranks:
        raise TraceFileError(f"{where}: header {','.join(cells)!r} has no count column (num_tokens, or "
                             "dp0,dp1,... one per DP rank)")
    missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
    if missing:
        raise TraceFileError(f"{where}: header has dp{max(ranks)} but no {', '.join(f'dp{r}' for r in missing)} "
                             "(one column per DP rank, dp0 up)")
    counts = tuple(num_tokens) or tuple(ranks[r] for r in sorted(ranks))
    return _Header(len(cells), counts, tuple(ignored), per_dp_rank=bool(ranks))


def _cells(line: str) -> list[str]:
    """The stripped cells of a CSV line (a quoted cell may hold a comma, as an engine's timestamp might)."""
    return [c.strip() for c in next(csv.reader([line]))] if '"' in line else [c.strip() for c in line.split(",")]


def read_trace_file(name: str) -> TraceFile:
    """Parse and validate a trace file (see the module docstring), streaming: one line at a time, the sha256 of
    the bytes computed on the way, the counts kept as int32. A file read before and unchanged since (same size
    and modification time) is not read again."""
    path = resolve_trace_file(name)
    st = path.stat()
    return _read(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int, inode: int) -> TraceFile:
    digest = hashlib.sha256()
    counts = array("i")
    header = None
    with open(path, "rb") as f:
        lines = _numbered_lines(f, digest)
        for number, raw in lines:  # up to the header
            stripped = _text(raw, path, number).strip()
            if stripped and not stripped.startswith("#"):
                header = _header(_cells(stripped), f"{path}: line {number}")
                break
        columns = len(header.counts) if header else 0
        for number, raw in lines:  # the steps
            if header.plain and _COUNTS_LINE.fullmatch(raw):  # the common case in one match (int() takes bytes)
                values = list(map(int, raw.split(b",")))
                if len(values) != columns or max(values) > MAX_TOKENS:
                    values = _parse_line(raw.decode("ascii").strip(), header, f"{path}: line {number}")
            else:
                stripped = _text(raw, path, number).strip()
                if not stripped or stripped.startswith("#"):
                    continue
                values = _parse_line(stripped, header, f"{path}: line {number}")
            counts.extend(values)
            if len(counts) > MAX_COUNTS:
                raise TraceFileError(f"{path}: line {number}: more than {MAX_COUNTS:,} token counts (steps x "
                                     "columns: the table as int32 would pass 1 GiB)")
    if not columns:
        raise TraceFileError(f"{path}: line 1: no header (num_tokens, or dp0,dp1,...)")
    if not counts:
        raise TraceFileError(f"{path}: no steps after the header")
    table = np.frombuffer(counts, dtype=np.intc).astype(np.int32, copy=False).reshape(-1, columns)
    table.flags.writeable = False
    return TraceFile(path, digest.hexdigest(), columns, table, header.ignored, header.per_dp_rank)


def _numbered_lines(f, digest):
    """(line number, bytes) of each line of the binary file f, every byte going through digest on the way; a bare
    carriage return ends a line too (old Mac line ends), as in text read with universal newlines."""
    number = 0
    for raw in f:
        digest.update(raw)
        if number == 0 and raw.startswith(_BOM):  # the digest keeps the file's own bytes
            raw = raw[len(_BOM):]
        cr = raw.find(b"\r")
        if 0 <= cr < len(raw) - 2:
            for part in raw.splitlines(keepends=True):
                number += 1
                yield number, part
        else:
            number += 1
            yield number, raw


def _text(raw: bytes, path: str, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFileError(f"{path}: line {number}: not UTF-8 text") from None


def _parse_line(stripped: str, header: _Header, where: str) -> list[int]:
    """A data line cell by cell (what the one-match check of the common case leaves): its counts, or the
    TraceFileError of its first problem, left to right; the ignored columns' cells are not read."""
    cells = _cells(stripped)
    if len(cells) != header.width:
        raise TraceFileError(f"{where}: {len(cells)} values, the header has {header.width}")
    counts = [cells[i] for i in header.counts]
    for c in counts:
        if not c.isdigit() or not c.isascii():
            raise TraceFileError(f"{where}: {c!r} is not a token count (a whole number >= 0)")
        if int(c) > MAX_TOKENS:
            raise TraceFileError(f"{where}: {c} tokens, over the limit of {MAX_TOKENS:,}")
    return [int(c) for c in counts]


def ignored_columns_note(name: str) -> str | None:
    """What the run's header says of the columns of trace file `name` that are no counts (skipped), or None."""
    try:
        ignored = read_trace_file(name).ignored_columns
    except (TraceFileError, OSError):  # the sweep loader refused such a file already
        return None
    if not ignored:
        return None
    return "ignored columns, not token counts: " + ", ".join(c or "(unnamed)" for c in ignored)


def trace_file_problem(name: str | None, dp_size: int) -> str | None:
    """Why `trace_file: name` cannot be used with `dp_size` DP ranks, or None (the sweep loader calls this)."""
    if name is None:
        return None
    try:
        read_trace_file(name).check_dp_size(dp_size)
    except TraceFileError as e:
        return str(e)
    except OSError as e:
        return f"{name}: cannot read ({e.strerror})"
    return None
