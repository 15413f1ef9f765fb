"""Multi-rank points through the runner on the CPU (gloo): self-spawned ranks, and a torchrun launch where every
rank runs `moebench run` and only rank 0 writes."""

import os
import socket
import subprocess
import sys
import textwrap

from moebench.cli import main
from moebench.run.results import load_records

SWEEP = textwrap.dedent("""\
    name: mr
    target: dispatch
    impls: [dispatch.a2a, dispatch.agrs]
    fixed: {num_tokens: 8, hidden: 64, num_experts: 6, top_k: 2, padding_ratio: 0.5, padding_fill: repeat}
    axes:
      ep_size: [2, 3]
    timing: {mode: events, warmup: 0, iters: 1}
    """)  # one timed call of 8 tokens a rank: the interpreter runs dispatch.a2a's pack / combine once per token


# the spawned groups' sweep: agrs only (torch-speed kernels in the interpreter), two points per group, so the test's
# time is the five rank starts; dispatch.a2a on spawned real ranks goes through the runner in test_scenarios.py
# (sp_padding_ep2_real) and against its reference in tests/dispatch
SPAWNED = SWEEP.replace("impls: [dispatch.a2a, dispatch.agrs]", "impls: [dispatch.agrs]").replace(
    "padding_ratio: 0.5, ", "").replace("ep_size: [2, 3]", "ep_size: [2, 3]\n  padding_ratio: [0.0, 0.5]")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_spawned_ranks_record_every_point(tmp_path, capsys, monkeypatch):
    """The runner in this process spawns the rank groups (one per ep_size) itself."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "s.yaml").write_text(SPAWNED)
    code = main(["run", str(tmp_path / "s.yaml"), "--device", "cpu", "--out", str(tmp_path / "r"), "--no-plots"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:] + out[-2000:]
    (run_dir,) = list((tmp_path / "r").iterdir())
    recs = load_records(run_dir)
    assert sorted((r["params"]["ep_size"], r["params"]["padding_ratio"]) for r in recs) == [
        (2, 0.0), (2, 0.5), (3, 0.0), (3, 0.5)]
    for r in recs:
        assert r["status"] == "ok", r.get("reason")
        assert r["ranks"]["world_size"] == r["params"]["ep_size"]
        assert 0 <= r["ranks"]["slowest_rank"] < r["params"]["ep_size"]


def test_torchrun_launch_rank0_writes_once(tmp_path):
    (tmp_path / "s.yaml").write_text(SWEEP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "moebench", "run", str(tmp_path / "s.yaml"),
           "--device", "cpu", "--out", str(tmp_path / "r"), "--no-plots"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    dirs = list((tmp_path / "r").iterdir())
    assert len(dirs) == 1  # one run directory, made by rank 0
    recs = load_records(dirs[0])
    by = {(r["impl"], r["params"]["ep_size"]): r for r in recs}
    assert len(recs) == 4
    for impl in ("dispatch.a2a", "dispatch.agrs"):
        assert by[(impl, 2)]["status"] == "ok" and by[(impl, 2)]["ranks"]["world_size"] == 2
        assert by[(impl, 3)]["status"] == "skipped"
        assert by[(impl, 3)]["reason"] == "needs 3 ranks; torchrun started 2"
    assert proc.stdout.count("# moebench mr:") == 1  # only rank 0 prints the table
