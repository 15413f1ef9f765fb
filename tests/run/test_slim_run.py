"""scripts/slim_run.py: a slimmed run loads, compares and reports as before (only the raw samples, JIT compile keys
and a trace's per-shape EP loads go), a second slim changes nothing, and a directory that is no run is refused
with nothing written."""

import json
import runpy
import shutil
from pathlib import Path

import pytest

from moebench.report.compare import compare_records
from moebench.run.results import load_manifest, load_records

REPO = Path(__file__).resolve().parents[2]
SLIM = runpy.run_path(str(REPO / "scripts" / "slim_run.py"))
# the smallest committed serving_trace reference (a trace record carries every field slim_run drops)
TRACE_RUN = min((REPO / "results" / "h200" / "scenarios").glob("padding_tax-*"),
                key=lambda d: (d / "records.jsonl").stat().st_size)


def _fat_run(tmp_path: Path) -> Path:
    """A copy of a committed run with the fields slim_run drops put back in."""
    run = tmp_path / "run"
    shutil.copytree(TRACE_RUN, run)
    recs = load_records(run)
    for rec in recs:
        rec["samples_us"] = [1.0, 2.0, 3.0]
        rec["jit"]["kernels"] = [{"kernel": "k", "key": "x" * 50}]
        for shape in rec["info"]["shapes"]:
            shape["rank_loads"] = {"masked": [1, 2], "oblivious": [3, 4]}
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_slim_keeps_what_is_read_and_drops_the_rest(tmp_path):
    run = _fat_run(tmp_path)
    fat = load_records(run)
    assert SLIM["main"]([str(run)]) == 0
    slim = load_records(run)
    assert len(slim) == len(fat) >= 1
    for a, b in zip(fat, slim):
        assert "samples_us" not in b and "kernels" not in b["jit"]
        assert all("rank_loads" not in s for s in b["info"]["shapes"])
        assert b["stats"] == a["stats"] and b["jit"]["compiles"] == a["jit"]["compiles"]
        assert b["info"]["headline"] == a["info"]["headline"] and b["info"]["trace_steps"] == a["info"]["trace_steps"]
    assert load_manifest(run)["slimmed"]["by"] == "scripts/slim_run.py"
    text = (run / "records.jsonl").read_text()
    assert SLIM["main"]([str(run)]) == 0 and (run / "records.jsonl").read_text() == text  # idempotent
    rows = compare_records(load_records(TRACE_RUN), load_records(run))
    assert rows and all(abs(r["ratio"] - 1.0) < 1e-12 for r in rows)


def _state(run: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


@pytest.mark.parametrize("spoil", ["no_run", "torn_line", "nan", "not_a_record", "locked"])
def test_slim_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys, spoil):
    from moebench.run.lock import RunLock

    good, bad = _fat_run(tmp_path), tmp_path / "bad"
    if spoil == "no_run":
        bad.mkdir()
    else:
        shutil.copytree(good, bad)
        records = bad / "records.jsonl"
        extra = {"torn_line": '{"key": "x", "stats": {"p5', "nan": '{"key": "x", "stats": {"p50": NaN}}',
                 "not_a_record": "[1, 2]", "locked": ""}[spoil]
        records.write_text(records.read_text() + extra + "\n")
    before = {d: _state(d) for d in (good, bad)}
    lock = RunLock(bad).acquire() if spoil == "locked" else None
    try:
        assert SLIM["main"]([str(good), str(bad)]) == 2
    finally:
        if lock:
            lock.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slim_run.py: "), err
    want = {"no_run": "not a run directory", "torn_line": "line ", "nan": "line ", "not_a_record": "not a JSON object",
            "locked": "in use by"}[spoil]
    assert want in err[0]
    assert {d: _state(d) for d in (good, bad)} == before  # the good run beside it untouched too, no tmp file left


def test_slim_keeps_the_step_files(tmp_path):
    import numpy as np

    from moebench.traces.step_file import read_step_columns, write_step_columns

    run = _fat_run(tmp_path)
    rel = write_step_columns(run, load_records(run)[0]["key"], {"layer_us": np.arange(4, dtype=np.float32)},
                             {"sides": ["masked"]})
    before = (run / rel).read_bytes()
    assert SLIM["main"]([str(run)]) == 0
    assert (run / rel).read_bytes() == before
    columns, meta = read_step_columns(run, rel)
    assert columns["layer_us"].tolist() == [0.0, 1.0, 2.0, 3.0] and meta == {"sides": ["masked"]}


def test_per_expert_loads_a_point_repeats_are_kept_once():
    """Records of one point routed alike keep their per-expert lists once (the first), the others name its point;
    a record routed otherwise (a pre-fix twin) and a record of another point keep theirs."""
    loads = {"per_expert_real": [3, 1, 2], "per_expert_padding": [0, 4, 0], "expert": {"max_over_mean": 1.2}}
    twin = {"per_expert_real": [3, 1, 2], "per_expert_padding": [4, 0, 0]}
    recs = [{"point": 0, "params": {"T": 8}, "imbalance": json.loads(json.dumps(loads))},
            {"point": 1, "params": {"T": 8}, "imbalance": json.loads(json.dumps(loads))},
            {"point": 2, "params": {"T": 8}, "imbalance": dict(twin)},
            {"point": 3, "params": {"T": 16}, "imbalance": json.loads(json.dumps(loads))},
            {"point": 4, "params": {"T": 8}}]
    SLIM["dedup_expert_loads"](recs)
    assert recs[0]["imbalance"] == loads and recs[3]["imbalance"] == loads and recs[2]["imbalance"] == twin
    assert recs[1]["imbalance"] == {"expert": {"max_over_mean": 1.2}, "per_expert_of_point": 0}
    assert "imbalance" not in recs[4]
