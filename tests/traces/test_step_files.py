"""Per-step figures in a file of their own (moebench.traces.step_file): written atomically, read back exactly,
replaced when a point runs again; and the run directory handed to every point (RunContext.run_dir) in the point
worker, in the runner's own process and on the ranks of a multi-rank group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moebench.registry import RunContext
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import load_sweep
from moebench.traces import step_file
from moebench.traces.step_file import read_step_columns, write_step_columns


def _columns(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"rows": rng.integers(0, 1 << 20, n).astype(np.int32), "layer_us": rng.random(n).astype(np.float32),
            "tax": rng.random(n)}


def test_step_columns_round_trip_and_a_rerun_replaces_the_file(tmp_path):
    cols = _columns(1000, 1)
    rel = write_step_columns(tmp_path, "0123abcd", cols, {"sides": ["masked", "oblivious"], "steps": 1000})
    assert rel == "steps/0123abcd.npz" and (tmp_path / rel).is_file()
    got, meta = read_step_columns(tmp_path, rel)
    assert meta == {"sides": ["masked", "oblivious"], "steps": 1000} and set(got) == set(cols)
    for name, values in cols.items():
        assert got[name].dtype == values.dtype and np.array_equal(got[name], values)
    again = _columns(10, 2)  # the point re-run after a kill: its file replaced, not doubled
    assert write_step_columns(tmp_path, "0123abcd", again, {}) == rel
    got, meta = read_step_columns(tmp_path, rel)
    assert meta == {} and np.array_equal(got["tax"], again["tax"])
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["0123abcd.npz"]


def test_a_write_that_fails_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    rel = write_step_columns(tmp_path, "k1", _columns(50, 3), {"n": 1})

    def torn(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(step_file.np, "savez", torn)
    with pytest.raises(OSError, match="disk full"):
        write_step_columns(tmp_path, "k1", _columns(60, 4), {"n": 2})
    monkeypatch.undo()
    got, meta = read_step_columns(tmp_path, rel)
    assert meta == {"n": 1} and got["rows"].shape == (50,)
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["k1.npz"]  # no temporary file left
    (tmp_path / "steps" / ".k1.npz.x.tmp").write_bytes(b"left by a killed write")
    write_step_columns(tmp_path, "k1", _columns(5, 5), {})
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["k1.npz"]


@pytest.mark.parametrize("key,columns,meta,message", [
    ("../up", {"a": np.zeros(2, np.int32)}, {}, "point key"),
    ("k", {"a": np.zeros(2, np.int64)}, {}, "column a: int64"),
    ("k", {"a": np.zeros((2, 2), np.float32)}, {}, "column a: float32 of shape"),
    ("k", {"a": np.zeros(2, np.int32), "b": np.zeros(3, np.float64)}, {}, "column b: 3 values"),
    ("k", {"__meta__": np.zeros(2, np.int32)}, {}, "column name"),
    ("k", {"a": np.zeros(2, np.int32)}, {"x": float("nan")}, "meta is not JSON"),
])
def test_bad_step_columns_are_refused(tmp_path, key, columns, meta, message):
    with pytest.raises(ValueError, match=message):
        write_step_columns(tmp_path, key, columns, meta)
    assert not list(tmp_path.rglob("*.npz"))


def test_a_step_file_outside_steps_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a file of steps/"):
        read_step_columns(tmp_path / "run", "../elsewhere/x.npz")


PLUGIN = '''
import os

import numpy as np

from moebench import registry
from moebench.check import CheckResult
from moebench.registry import Case
from moebench.traces.step_file import write_step_columns


def build(p, ctx):
    rel = None
    if ctx.run_dir is not None:
        rel = write_step_columns(ctx.run_dir, f"probe-{p.num_tokens}", {"n": np.arange(p.num_tokens, dtype=np.int32)},
                                 {"pid": os.getpid()})
    return Case(run=lambda: None, check=lambda: CheckResult(True),
                info={"run_dir": str(ctx.run_dir), "pid": os.getpid(), "step_file": rel})


if "testonly_rundir.probe" not in registry.all_impls():
    registry.register_impl("testonly_rundir.probe", targets=("kernel",))(build)
'''

SWEEP = """\
name: rundir
target: kernel
plugins: [moebench_test_rundir_plugin]
impls: [testonly_rundir.probe]
axes: {num_tokens: [3, 5]}
timing: {warmup: 0, iters: 1}
"""


@pytest.mark.parametrize("isolate", [True, False], ids=["point worker", "in process"])
def test_every_point_of_a_run_gets_the_run_directory(tmp_path, monkeypatch, isolate):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "moebench_test_rundir_plugin.py").write_text(PLUGIN)
    (tmp_path / "s.yaml").write_text(SWEEP)
    sweep = load_sweep(tmp_path / "s.yaml")
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "runs", device="cpu", isolate=isolate)
    assert code == 0
    recs = load_records(run_dir)
    assert len(recs) == 2
    for rec in recs:
        assert rec["info"]["run_dir"] == str(Path(run_dir).absolute()), rec
        assert (rec["info"]["pid"] != os.getpid()) == isolate and "isolation" not in rec
        cols, meta = read_step_columns(run_dir, rec["info"]["step_file"])
        assert cols["n"].tolist() == list(range(rec["params"]["num_tokens"])) and meta["pid"] == rec["info"]["pid"]


def test_the_ranks_of_a_multi_rank_group_get_the_run_directory(tmp_path, monkeypatch):
    """The body every rank runs (spawned or under torchrun), on a rank of one."""
    from moebench.run.multirank import _world_worker

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "moebench_test_rundir_plugin.py").write_text(PLUGIN)
    (tmp_path / "s.yaml").write_text(SWEEP)
    sweep = load_sweep(tmp_path / "s.yaml")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _world_worker(RunContext(device=torch.device("cpu")), sweep.to_dict(), sweep.source, [1], str(run_dir),
                  show=lambda rec: None)
    (rec,) = load_records(run_dir)
    assert rec["info"]["run_dir"] == str(run_dir.absolute()) and rec["info"]["step_file"] == "steps/probe-5.npz"
