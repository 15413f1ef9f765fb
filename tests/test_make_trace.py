"""scripts/make_trace.py: a long serving trace CSV from the project's seeded distributions, one column per DP rank
(drawn apart) or one for all, read back by the trace reader; the same arguments write the same file; bad arguments
are one line and exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moebench.traces.csv_trace import read_trace_file
from moebench.traces.distributions import rank_tokens

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_trace.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_one_column_per_dp_rank_drawn_apart_and_read_back(tmp_path):
    out = tmp_path / "t.csv"
    assert _run(out, "--steps", 300, "--dp-size", 2, "--max-tokens", 512).returncode == 0
    trace = read_trace_file(str(out))
    assert trace.num_steps == 300 and trace.columns == 2
    table = trace.table.tolist()
    assert [row[1] for row in table] == rank_tokens("prefill_heavy", 300, 512, 0, 1)
    assert any(a != b for a, b in table)  # the ranks are drawn apart
    first = out.read_bytes()
    assert _run(out, "--steps", 300, "--dp-size", 2, "--max-tokens", 512).returncode == 0
    assert out.read_bytes() == first  # the same arguments, the same file
    same = tmp_path / "s.csv"
    assert _run(same, "--steps", 50, "--same-counts").returncode == 0
    assert read_trace_file(str(same)).columns == 1  # one column for every DP rank


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path):
    for args, why in [(("--steps", 0), "--steps must be >= 1"),
                      (("--max-tokens", -1), "--max-tokens must be >= 1")]:
        got = _run(tmp_path / "x.csv", *args)
        assert got.returncode == 2 and why in got.stderr and got.stderr.count("\n") == 1
    got = _run(tmp_path / "missing" / "x.csv")
    assert got.returncode == 2 and "its directory does not exist" in got.stderr and got.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
