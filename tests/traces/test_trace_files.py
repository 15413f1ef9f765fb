"""Trace files as long as a real server's: the CSV reader streams (no byte limit, a bound on the token table
instead), holds the counts as int32, and gives the distinct steps of a trace with each step's index into them."""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter

import numpy as np
import pytest

from moebench.traces import csv_trace
from moebench.traces.csv_trace import TraceFileError, read_trace_file
from moebench.traces.distinct import distinct_steps


def _write_trace(path, table: np.ndarray) -> None:
    header = "num_tokens" if table.shape[1] == 1 else ",".join(f"dp{r}" for r in range(table.shape[1]))
    lines = [",".join(map(str, row)) for row in table.tolist()]
    path.write_text("# generated\n" + header + "\n" + "\n".join(lines) + "\n")


def test_a_file_over_a_mebibyte_is_read_streaming(tmp_path):
    rng = np.random.default_rng(5)
    table = rng.integers(10_000, 100_000, size=(100_000, 2))  # 12 bytes a line
    path = tmp_path / "long.csv"
    _write_trace(path, table)
    assert path.stat().st_size > 1 << 20  # over the sweep-file limit that used to refuse it
    f = read_trace_file(str(path))
    assert f.table.dtype == np.int32 and f.table.shape == (100_000, 2) and f.num_steps == 100_000
    assert np.array_equal(f.table, table)
    assert f.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert f.per_rank(2)[:3] == table[:3].tolist()
    d = f.distinct_steps(2)
    assert np.array_equal(np.asarray(d.steps)[d.index], table)
    assert read_trace_file(str(path)).distinct_steps(2) is d and not d.index.flags.writeable  # once per file


def test_whitespace_crlf_and_cr_lines_read_like_plain_ones(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"dp0,dp1\r\n 3 , 4 \r\n5,\xc2\xa06\n\n# note\n7,8")  # a no-break space, no final newline
    f = read_trace_file(str(path))
    assert f.tokens == ((3, 4), (5, 6), (7, 8))
    mac = tmp_path / "mac.csv"
    mac.write_bytes(b"num_tokens\r3\r\r5\rx\r")  # carriage returns alone end lines too
    with pytest.raises(TraceFileError, match=r"mac\.csv: line 5: 'x' is not a token count"):
        read_trace_file(str(mac))
    mac.write_bytes(b"num_tokens\r3\r\r5\r")
    assert read_trace_file(str(mac)).tokens == ((3,), (5,))
    assert read_trace_file(str(mac)).sha256 == hashlib.sha256(mac.read_bytes()).hexdigest()


def test_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"\xef\xbb\xbfdp0,dp1\r\n3,4\r\n")  # a spreadsheet's "CSV UTF-8"
    f = read_trace_file(str(path))
    assert f.tokens == ((3, 4),) and f.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_bytes(b"\xef\xbb\xbf# exported\nnum_tokens\n7\n")
    assert read_trace_file(str(path)).tokens == ((7,),)


def test_an_engine_export_is_read_by_its_count_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('step,timestamp,dp1,dp0,note\n'
                    '0,2024-01-01T10:00:00.5,3,4,\n'
                    '1,"Jan 1, 10:00:01",5,6,x y\n')  # a quoted cell holding a comma
    f = read_trace_file(str(path))
    assert f.tokens == ((4, 3), (6, 5)) and f.columns == 2  # by name: dp0 first
    assert f.ignored_columns == ("step", "timestamp", "note")
    assert csv_trace.ignored_columns_note(str(path)) == "ignored columns, not token counts: step, timestamp, note"
    index = tmp_path / "pandas.csv"  # DataFrame.to_csv() writes its index under an empty name
    index.write_text(",num_tokens\n0,8\n1,9\n")
    assert read_trace_file(str(index)).tokens == ((8,), (9,))
    assert csv_trace.ignored_columns_note(str(index)) == "ignored columns, not token counts: (unnamed)"
    path.write_text("step,dp0,dp1\n0,3,x\n")  # a count column is still checked; an ignored one is not read
    with pytest.raises(TraceFileError, match=r"line 2: 'x' is not a token count"):
        read_trace_file(str(path))
    path.write_text("step,dp0,dp1\n0,3\n")
    with pytest.raises(TraceFileError, match=r"line 2: 2 values, the header has 3"):
        read_trace_file(str(path))


@pytest.mark.parametrize("header,message", [
    ("step,timestamp", "has no count column (num_tokens, or dp0,dp1,..."),
    ("num_tokens,dp0", "both num_tokens and dp<rank> columns"),
    ("dp0,dp2", "has dp2 but no dp1"),
    ("dp0,dp1,dp0", "names dp0 twice"),
])
def test_count_columns_that_make_no_trace_are_refused(tmp_path, header, message):
    path = tmp_path / "t.csv"
    path.write_text(header + "\n" + ",".join(["1"] * len(header.split(","))) + "\n")
    with pytest.raises(TraceFileError, match=rf"line 1: header .*{re.escape(message)}"):
        read_trace_file(str(path))


def test_the_token_table_bound_is_refused_at_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(csv_trace, "MAX_COUNTS", 6)
    path = tmp_path / "t.csv"
    path.write_text("dp0,dp1\n1,2\n3,4\n# c\n5,6\n7,8\n")
    with pytest.raises(TraceFileError, match=r"t\.csv: line 6: more than 6 token counts"):
        read_trace_file(str(path))


def test_a_changed_file_is_read_again(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_tokens\n1\n2\n")
    assert read_trace_file(str(path)).tokens == ((1,), (2,))
    path.write_text("num_tokens\n1\n2\n30\n")
    os.utime(path, ns=(1, 1))  # another size and mtime than the cached read's
    assert read_trace_file(str(path)).tokens == ((1,), (2,), (30,))


@pytest.mark.parametrize("high", [5, 1 << 40], ids=["small counts", "wide counts (lexsort)"])
@pytest.mark.parametrize("dp", [1, 3])
def test_distinct_steps_round_trip(dp, high):
    rng = np.random.default_rng(dp)
    trace = rng.integers(0, high, size=(2000, dp)).tolist()
    trace += trace[:50]  # repeats of wide rows too
    d = distinct_steps(trace)
    assert np.array_equal(np.asarray(d.steps)[d.index], np.asarray(trace))
    assert d.index.dtype == np.int32 and d.num_steps == len(trace)
    assert len(set(d.steps)) == len(d.steps) and int(d.counts.sum()) == len(trace)
    first = {}
    for i, step in enumerate(map(tuple, trace)):
        first.setdefault(step, i)
    assert list(d.steps) == sorted(first, key=first.get)  # first-appearance order
    seen = Counter(map(tuple, trace))
    assert d.counts.tolist() == [seen[step] for step in d.steps]


def test_distinct_steps_small_cases_and_refusals():
    d = distinct_steps([[3, 5], [8, 1], [3, 5]])
    assert d.steps == ((3, 5), (8, 1)) and d.counts.tolist() == [2, 1] and d.index.tolist() == [0, 1, 0]
    assert distinct_steps([]).steps == () and distinct_steps([]).num_steps == 0
    with pytest.raises(ValueError):
        distinct_steps([[1, 2], [3]])
    with pytest.raises(ValueError):
        distinct_steps([[0.5, 1.0]])


def test_a_one_column_file_gives_every_dp_rank_its_count(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_tokens\n4\n9\n4\n")
    f = read_trace_file(str(path))
    d = f.distinct_steps(3)
    assert d.steps == ((4, 4, 4), (9, 9, 9)) and d.index.tolist() == [0, 1, 0]
    assert f.per_rank(3) == [[4, 4, 4], [9, 9, 9], [4, 4, 4]]
    two = tmp_path / "two.csv"
    two.write_text("dp0,dp1\n1,2\n")
    with pytest.raises(TraceFileError, match="dp0,dp1 DP columns, but dp_size is 3"):
        read_trace_file(str(two)).distinct_steps(3)


def test_a_lone_dp0_column_is_rank_0s_alone_not_every_ranks(tmp_path):
    path = tmp_path / "dp0.csv"
    path.write_text("step,dp0\n1,4\n2,9\n")
    f = read_trace_file(str(path))
    assert f.per_rank(1) == [[4], [9]]
    with pytest.raises(TraceFileError, match=r"dp0 DP column, but dp_size is 2 \(one num_tokens column gives every"):
        f.per_rank(2)
    from moebench.bench.serving_trace.knobs import ServingKnobs
    from moebench.params import Params

    why = ServingKnobs(dp_size=2, trace_file=str(path)).problem(Params())
    assert why.startswith("trace_file: ") and "dp0 DP column, but dp_size is 2" in why
