"""The runner end to end on the CPU: records, summary, table, statuses, resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from moebench import registry
from moebench.cli import main
from moebench.registry import Case, CheckResult, Impl, Routing
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import sweep_from_dict

SWEEP = """\
name: rt
target: router
impls: [topk_softmax.torch]
fixed: {num_experts: 16, top_k: 2, padding_fill: repeat}
axes:
  num_tokens: [8, 32]
  padding_ratio: [0.0, 0.5]
  mask: [true, false]
timing: {warmup: 1, iters: 5}
"""


def _fake_impls():
    """Impls that exercise the runner's wrong / failed paths (registered once per process)."""
    if "testonly.wrong" in registry.all_impls():
        return

    def build_wrong(p, ctx):
        return Case(run=lambda: None, check=lambda: CheckResult(False, "ids: 3/8 differ"))

    def build_raises(p, ctx):
        raise RuntimeError("boom\nsecond line of a long message")

    def build_ok(p, ctx):
        ids = torch.tensor([[0, 1], [0, 1], [-1, -1], [2, 3]], dtype=torch.int32)
        pad = torch.tensor([False, False, True, False])
        x = torch.ones(1000)
        return Case(run=lambda: x.mul_(1.0), check=lambda: CheckResult(True), bytes_moved=8000,
                    routing=Routing(ids, pad, num_experts=4, ep_size=2))

    registry.register(Impl("testonly.wrong", ("kernel",), build_wrong))
    registry.register(Impl("testonly.raises", ("kernel",), build_raises))
    registry.register(Impl("testonly.ok", ("kernel",), build_ok))
    registry.register(Impl("testonly.unavailable", ("kernel",), build_ok, available=lambda ctx: "needs a unicorn"))


def test_statuses_recorded_and_sweep_goes_on(tmp_path, capsys):
    _fake_impls()
    sweep = sweep_from_dict({"name": "st", "target": "kernel",
                             "impls": ["testonly.wrong", "testonly.raises", "testonly.ok", "testonly.unavailable"],
                             "axes": {"num_tokens": [4]}, "timing": {"warmup": 1, "iters": 4}})
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu")
    assert code == 1  # a wrong or failed point makes the run fail
    recs = {r["impl"]: r for r in load_records(run_dir)}
    assert recs["testonly.wrong"]["status"] == "wrong" and "samples_us" not in recs["testonly.wrong"]
    assert recs["testonly.raises"]["status"] == "failed"
    assert recs["testonly.raises"]["reason"] == "RuntimeError: second line of a long message"
    ok = recs["testonly.ok"]
    assert ok["status"] == "ok" and ok["timing_mode"] == "wall" and len(ok["samples_us"]) == 4
    assert set(ok["stats"]) >= {"p50", "p10", "p90", "min", "max", "mean", "cv"}
    assert ok["imbalance"]["per_expert_real"] == [2, 2, 1, 1]
    assert recs["testonly.unavailable"]["status"] == "skipped"
    assert recs["testonly.unavailable"]["reason"] == "needs a unicorn"
    out = capsys.readouterr().out
    assert "failures:" in out and "boom" not in out.split("failures:")[0].splitlines()[-1]
    assert (run_dir / "summary.csv").read_text().count("\n") == 5
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["sweep"]["name"] == "st" and manifest["env"]["torch"] == torch.__version__


def test_router_sweep_end_to_end(tmp_path, capsys):
    sweep_path = tmp_path / "rt.yaml"
    sweep_path.write_text(SWEEP)
    code = main(["run", str(sweep_path), "--out", str(tmp_path / "r"), "--plots", str(tmp_path / "p"),
                 "--device", "cpu"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr + stdout
    (run_dir,) = list((tmp_path / "r").iterdir())
    recs = load_records(run_dir)
    assert len(recs) == 8 and all(r["status"] == "ok" for r in recs)
    # unmasked repeat-filled padding is routed: padding routes show up; masked: none
    for r in recs:
        pad_routes = sum(r["imbalance"]["per_expert_padding"])
        if r["params"]["padding_ratio"] > 0 and not r["params"]["mask"]:
            assert pad_routes == r["params"]["num_tokens"] // 2 * 2
        else:
            assert pad_routes == 0
    header = [line for line in stdout.splitlines() if line.lstrip().startswith("#") and "impl" in line]
    assert header, stdout


def _records_count(path):
    return sum(1 for line in open(path) if line.endswith("\n")) if os.path.exists(path) else 0


def test_resume_after_kill(tmp_path, capsys):
    sweep_path = tmp_path / "slow.yaml"
    sweep_path.write_text(textwrap.dedent("""\
        name: slow
        target: router
        impls: [topk_softmax.torch]
        fixed: {num_experts: 16, top_k: 2}
        axes:
          num_tokens: [8, 16, 24, 32, 40, 48]
        timing: {mode: wall, warmup: 0, iters: 100000, max_seconds: 0.25}
        """))
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "moebench", "run", str(sweep_path), "--out", str(out), "--device", "cpu",
           "--no-plots"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    records = None
    while time.time() < deadline:
        dirs = list(out.iterdir()) if out.exists() else []
        if dirs and _records_count(dirs[0] / "records.jsonl") >= 2:
            records = dirs[0] / "records.jsonl"
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert records is not None, "the run never recorded two points"
    n_before = _records_count(records)
    assert 2 <= n_before < 6
    with open(records, "ab") as f:  # a torn line, as if killed mid-write
        f.write(b'{"point": 99, "key": "tor')
    run_dir = records.parent
    code = main(cmd[3:] + ["--resume", str(run_dir)])  # the resume in this process
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    recs = load_records(run_dir)
    assert sorted(r["point"] for r in recs) == list(range(6))  # every point once, the torn line gone
    assert f"resuming: {n_before} points" in stdout
