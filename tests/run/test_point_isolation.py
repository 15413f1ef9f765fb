"""A kernel that aborts, hangs, raises or faults on the GPU costs its point, never the run: the point is recorded
failed with the reason, a fresh worker takes the next point, and the later points are ok."""

import os
import sys
import textwrap

import pytest
import torch

from moebench.cli import main
from moebench.run import point_worker
from moebench.run.results import load_records

# A router plugin that misbehaves at one batch size (16 tokens) and is a correct router everywhere else.
PLUGIN = '''
import os
import signal
import time

import torch

from moebench.plugins import register_kernel


def _route(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if is_padding is not None:
        weights = weights.masked_fill(is_padding[:, None], 0.0)
        ids = ids.masked_fill(is_padding[:, None], -1)
    out[0].copy_(weights)
    out[1].copy_(ids)
    return out


def _misbehaving(what):
    def route(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        if logits.shape[0] == 16:
            if what == "abort":
                os.abort()  # what a segfaulting extension does to its process
            if what == "hang":
                time.sleep(3600)  # a deadlocked kernel
            if what == "raise":
                raise RuntimeError("the kernel refused")
            if what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return _route(logits, top_k, renormalize, is_padding, bias, out=out)
    return route


for _what in ("abort", "hang", "raise", "kill"):
    register_kernel("topk_softmax", f"isolation_{_what}", _misbehaving(_what))
'''

SWEEP = """\
name: isolation-{what}
target: router
plugins: [moebench_test_isolation_plugin]
impls: [topk_softmax.isolation_{what}, topk_softmax.torch]
fixed: {{num_experts: 16, top_k: 2}}
axes:
  num_tokens: [8, 16, 32]
timing: {{mode: wall, warmup: 1, iters: 2, point_timeout_s: {timeout}}}
"""


def _run(tmp_path, what, timeout=60):
    (tmp_path / "moebench_test_isolation_plugin.py").write_text(PLUGIN)
    sweep = tmp_path / f"{what}.yaml"
    sweep.write_text(SWEEP.format(what=what, timeout=timeout))
    out = tmp_path / "runs"
    code = main(["run", str(sweep), "--out", str(out), "--device", "cpu", "--no-plots"])
    (run_dir,) = out.iterdir()
    return code, {(r["params"]["num_tokens"], r["impl"].split(".")[1]): r for r in load_records(run_dir)}


def _assert_one_point_lost(recs, what, reason):
    bad = recs[(16, f"isolation_{what}")]
    assert bad["status"] == "failed" and reason in bad["reason"], bad
    assert len(recs) == 6  # every point recorded once, the lost one included
    others = [r for k, r in recs.items() if k != (16, f"isolation_{what}")]
    assert all(r["status"] == "ok" and r["samples_us"] for r in others), others


@pytest.mark.parametrize("what, reason", [("abort", "worker died: SIGABRT"), ("kill", "worker died: SIGKILL")])
def test_a_kernel_that_kills_its_process_costs_one_point(tmp_path, capsys, what, reason):
    code, recs = _run(tmp_path, what)
    assert code == 1
    _assert_one_point_lost(recs, what, reason)
    assert recs[(16, f"isolation_{what}")]["worker_restarted"]
    assert "worker restarts: 1" in capsys.readouterr().out


def test_a_kernel_that_never_returns_is_killed_at_the_point_timeout(tmp_path, capsys):
    # 3 s, as the rank-group hang below: the router's other points (torch ops on 8-32 rows) take milliseconds
    code, recs = _run(tmp_path, "hang", timeout=3)
    assert code == 1
    _assert_one_point_lost(recs, "hang", "timeout after 3 s")
    assert "worker restarts: 1" in capsys.readouterr().out


def test_a_kernel_that_raises_is_failed_in_a_worker_that_carries_on_across_points_and_runs(tmp_path, capsys):
    w = point_worker.get_worker(torch.device("cpu"))  # the worker of this process's earlier runs, or a new one
    assert point_worker.get_worker(torch.device("cpu")) is w and w.alive()
    code, recs = _run(tmp_path, "raise")
    assert code == 1
    _assert_one_point_lost(recs, "raise", "RuntimeError: the kernel refused")
    assert not recs[(16, "isolation_raise")].get("worker_restarted")
    assert "worker restarts" not in capsys.readouterr().out
    assert point_worker.get_worker(torch.device("cpu")) is w  # no restart for a point that merely raised
    assert w.proc.pid != os.getpid()


def test_a_worker_found_dead_between_points_is_replaced_without_losing_a_point(tmp_path, capsys, monkeypatch):
    dead = point_worker.get_worker(torch.device("cpu"))  # the raise test's worker (kept), or a new one
    dead._wait_ready()  # it came up, then died idle (an OOM kill between points, say)
    dead.proc.kill()
    dead.proc.wait(10)
    monkeypatch.setattr(dead, "alive", lambda: True)  # as if it died after the check: the hand-over finds it gone
    code, recs = _run(tmp_path, "raise")
    assert code == 1 and len(recs) == 6
    assert [k for k, r in recs.items() if r["status"] != "ok"] == [(16, "isolation_raise")]
    assert not any("isolation" in r for r in recs.values())  # still in a worker, not left to the runner
    assert "worker restarts" not in capsys.readouterr().out  # the point never ran in the dead worker
    assert point_worker.get_worker(torch.device("cpu")) is not dead


def test_point_timeout_must_be_positive(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(what="raise", timeout=0).replace("plugins: [moebench_test_isolation_plugin]\n", "")
                     .replace("topk_softmax.isolation_raise, ", ""))
    assert main(["run", str(sweep), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "point_timeout_s" in err and len(err.splitlines()) == 1


OOB_PLUGIN = textwrap.dedent('''
    import triton
    import triton.language as tl

    from moebench.plugins import register_kernel
    from moebench_test_isolation_plugin import _route


    @triton.jit
    def _store_far_out_of_bounds(ptr, offset):
        tl.store(ptr + offset + tl.arange(0, 16), tl.zeros([16], dtype=tl.float32))


    def route(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        if logits.shape[0] == 16:  # an illegal address: the CUDA context is lost for good
            _store_far_out_of_bounds[(1,)](out[0], 1 << 40)
        return _route(logits, top_k, renormalize, is_padding, bias, out=out)


    register_kernel("topk_softmax", "isolation_oob", route)
''')


@pytest.mark.gpu
def test_an_out_of_bounds_triton_store_costs_one_point_on_the_gpu(tmp_path, capsys):
    (tmp_path / "moebench_test_isolation_plugin.py").write_text(PLUGIN)  # its correct router, reused
    (tmp_path / "moebench_test_isolation_oob.py").write_text(OOB_PLUGIN)
    sweep = tmp_path / "oob.yaml"
    sweep.write_text(SWEEP.format(what="oob", timeout=300).replace("moebench_test_isolation_plugin",
                                                                     "moebench_test_isolation_oob")
                     .replace("mode: wall, ", ""))
    out = tmp_path / "runs"
    assert main(["run", str(sweep), "--out", str(out), "--device", "cuda", "--no-plots"]) == 1
    (run_dir,) = out.iterdir()
    recs = {(r["params"]["num_tokens"], r["impl"].split(".")[1]): r for r in load_records(run_dir)}
    bad = recs[(16, "isolation_oob")]
    assert bad["status"] == "failed" and "the CUDA context was lost, worker restarted" in bad["reason"], bad
    assert "illegal memory access" in bad["reason"] or "illegal address" in bad["reason"], bad
    _assert_one_point_lost(recs, "oob", "worker restarted")
    assert "worker restarts: 1" in capsys.readouterr().out


PATH_PLUGIN = '''
import os
import time

import torch.distributed as dist

from moebench.dispatch.agrs import AGRSPath
from moebench.plugins import register_dispatch_path


def _misbehaving(at):
    class Path(AGRSPath):
        """AGRS whose rank 1 aborts (a crashing communication extension) or hangs at some batch sizes."""

        def dispatch(self, x, topk_ids, topk_weights, is_padding=None):
            what = at.get(x.shape[0])
            if what and dist.get_rank() == 1:
                if what == "abort":
                    os.abort()
                time.sleep(3600)
            return super().dispatch(x, topk_ids, topk_weights, is_padding)
    return Path


register_dispatch_path("isolation_ranks", _misbehaving({16: "abort", 32: "hang", 40: "abort"}))
'''

MULTI_RANK = """\
name: isolation-ranks
target: dispatch
plugins: [moebench_test_isolation_path]
impls: [dispatch.isolation_ranks]
fixed: {num_experts: 8, hidden: 64, top_k: 2, ep_size: 2}
axes:
  num_tokens: [8, 16, 24, 32, 40]
timing: {mode: wall, warmup: 0, iters: 3, point_timeout_s: 3}
"""
# three rank groups (each rank an interpreter start): 8, then a crash after that point of the group went well (16);
# a fresh group's 24, then a hang (32: 3 s, as the single-rank hang above; the clock starts with the point, not the
# group, so 8 and 24, each a group's first point, are ok); a crash at a fresh group's first point (40)
LOST = {16: "rank 1 of 2 failed: killed by SIGABRT", 32: "timeout after 3 s (rank group killed)",
        40: "rank 1 of 2 failed: killed by SIGABRT"}


def test_a_rank_that_crashes_or_hangs_costs_its_point_and_a_fresh_group_runs_the_rest(tmp_path, capsys):
    (tmp_path / "moebench_test_isolation_path.py").write_text(PATH_PLUGIN)
    sweep = tmp_path / "ranks.yaml"
    sweep.write_text(MULTI_RANK)
    out = tmp_path / "runs"
    assert main(["run", str(sweep), "--out", str(out), "--device", "cpu", "--no-plots"]) == 1
    (run_dir,) = out.iterdir()
    recs = {r["params"]["num_tokens"]: r for r in load_records(run_dir)}
    assert sorted(recs) == [8, 16, 24, 32, 40]  # each once
    for n, rec in recs.items():
        if n in LOST:
            assert rec["status"] == "failed" and LOST[n] in rec["reason"] and rec["worker_restarted"], rec
        else:
            assert rec["status"] == "ok", rec
    assert f"worker restarts: {len(LOST)}" in capsys.readouterr().out
    assert not (run_dir / ".in_flight").exists()


def test_a_worker_that_cannot_start_leaves_the_points_to_the_runner_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(point_worker, "WORKER_COMMAND", [sys.executable, "-c", "raise SystemExit(7)"])
    monkeypatch.setattr(point_worker, "_WORKERS", {})  # none yet; the process's own worker is back for the next test
    code, recs = _run(tmp_path, "raise")
    assert code == 1 and len(recs) == 6
    assert all("the point worker did not start: worker died: exit code 7" in r["isolation"] for r in recs.values())
    assert recs[(16, "isolation_raise")]["status"] == "failed"
    assert "the points run in this process" in capsys.readouterr().err


def test_in_process_runs_the_points_in_the_runner(tmp_path, monkeypatch):
    (tmp_path / "moebench_test_isolation_plugin.py").write_text(PLUGIN)
    sweep = tmp_path / "raise.yaml"
    sweep.write_text(SWEEP.format(what="raise", timeout=60))
    started = []
    monkeypatch.setattr(point_worker, "get_worker", lambda dev: started.append(dev))
    code = main(["run", str(sweep), "--out", str(tmp_path / "runs"), "--device", "cpu", "--no-plots",
                 "--in-process"])
    assert code == 1 and not started
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(r["status"] for r in load_records(run_dir)) == ["failed"] + ["ok"] * 5


def test_an_impl_registered_in_the_runner_alone_runs_there_and_says_so(tmp_path):
    from moebench import registry
    from moebench.registry import Case, CheckResult, Impl
    from moebench.run.runner import run_sweep
    from moebench.run.sweep import sweep_from_dict

    if "testonly.runner_only" not in registry.all_impls():
        x = torch.ones(8)
        registry.register(Impl("testonly.runner_only", ("kernel",),
                               lambda p, ctx: Case(run=lambda: x.mul_(1.0), check=lambda: CheckResult(True))))
    sweep = sweep_from_dict({"name": "ro", "target": "kernel", "impls": ["testonly.runner_only"],
                             "axes": {"num_tokens": [8]}, "timing": {"warmup": 0, "iters": 2}})
    code, run_dir = run_sweep(sweep, out_base=tmp_path, device="cpu")
    (rec,) = load_records(run_dir)
    assert code == 0 and rec["status"] == "ok"
    assert rec["isolation"] == "in-process: the impl is registered in the runner's process only"
