"""Killed and interrupted runs, a second writer, a changed sweep on resume: nothing lost, nothing doubled, no
process left behind. Multi-rank runs use 2 gloo ranks on the CPU (the NCCL code path); every subprocess is
bounded in time and its process group is killed afterwards."""

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moebench.cli import main
from moebench.run.results import load_manifest, load_records
from moebench.run.lock import LOCK, RunLock

MULTI_RANK = textwrap.dedent("""\
    name: mrfault
    target: dispatch
    impls: [dispatch.agrs]
    fixed: {num_tokens: 16, hidden: 64, num_experts: 8, top_k: 2, padding_ratio: 0.5, padding_fill: repeat,
            ep_size: 2}
    axes:
      seed: [0, 1, 2, 3, 4, 5]
    timing: {mode: wall, warmup: 0, iters: 20}
    """)  # about 0.5 s a point in the interpreter: a kill lands mid-run, and rows show while the resume runs
NUM_POINTS = 6

SINGLE = textwrap.dedent("""\
    name: tiny
    target: router
    impls: [topk_softmax.torch]
    fixed: {num_experts: 16, top_k: 2}
    axes:
      num_tokens: [8, 16]
    timing: {mode: wall, warmup: 0, iters: 2}
    """)


def _env():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _children(pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
    return kids


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def _lines(path):
    return sum(1 for line in open(path, "rb") if line.endswith(b"\n")) if path.exists() else 0


def _sigint_as_on_a_terminal():
    """In the child before exec: SIGINT at its default, as in a command started from a terminal. A suite started
    as a background job of a script inherits SIGINT ignored, and moebench (as Python) keeps an ignored SIGINT so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Run:
    """`moebench run` in its own process group, killed with its group whatever happens."""

    def __init__(self, tmp_path, args, **kw):
        self.stdout = open(tmp_path / f"stdout-{time.monotonic_ns()}.txt", "w+")
        self.stderr = open(tmp_path / f"stderr-{time.monotonic_ns()}.txt", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "moebench", "run", *map(str, args)], env=_env(),
                                     stdout=kw.get("stdout", self.stdout), stderr=self.stderr,
                                     start_new_session=True, text=True, preexec_fn=_sigint_as_on_a_terminal)

    def wait_for_records(self, out: Path, n: int, timeout_s: float = 300.0) -> Path:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = list(out.glob("*/records.jsonl"))
            if found and _lines(found[0]) >= n:
                return found[0].parent
            assert self.proc.poll() is None, self.text()
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} records after {timeout_s} s: {self.text()}")

    def text(self):
        self.stdout.seek(0)
        self.stderr.seek(0)
        return self.stdout.read()[-3000:] + self.stderr.read()[-3000:]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started, nothing else
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.stdout.close()
        self.stderr.close()


def _assert_all_gone(pids, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "rank processes outlived their parent"


def _kill_parent_mid_run(tmp_path, sig):
    sweep = tmp_path / "mr.yaml"
    sweep.write_text(MULTI_RANK)
    out = tmp_path / "runs"
    with _Run(tmp_path, [sweep, "--out", out, "--device", "cpu", "--no-plots"]) as run:
        run_dir = run.wait_for_records(out, 2)
        ranks = _children(run.proc.pid)
        assert len(ranks) >= 2, ranks  # two ranks (and multiprocessing's resource tracker)
        run.proc.send_signal(sig)
        rc = run.proc.wait(60)
        _assert_all_gone(ranks)
        n_after = _lines(run_dir / "records.jsonl")
        time.sleep(1.0)  # two points' time
        assert _lines(run_dir / "records.jsonl") == n_after, "records still being appended after the kill"
        assert 2 <= n_after < NUM_POINTS
        return rc, run_dir, n_after, run.text()


class _RowsAsRecorded:
    """A stdout that keeps the lines written to it and counts the table rows of `impl` as they come, noting how
    many records were on disk when the first one came."""

    def __init__(self, records: Path, impl: str):
        self.records, self.impl = records, impl
        self.lines: list[str] = []
        self.rows, self.first_row_at_records, self._part = 0, None, ""

    def write(self, text: str) -> int:
        *done, self._part = (self._part + text).split("\n")
        for line in done:
            self.lines.append(line)
            if line.strip().startswith(tuple("0123456789")) and self.impl in line:
                self.rows += 1
                if self.first_row_at_records is None:
                    self.first_row_at_records = _lines(self.records)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_sigkill_of_parent_kills_ranks_and_resume_records_each_point_once(tmp_path, monkeypatch):
    rc, run_dir, n_before, _ = _kill_parent_mid_run(tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert (run_dir / LOCK).exists()  # left by the killed run: stale, taken over below
    # resume with the stored sweep, in this process (the killed run above is the one that needed a process of its
    # own); rows must appear as points finish, not all at the end
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    argv = ["moebench", "run", "--resume", str(run_dir), "--device", "cpu", "--no-plots"]
    monkeypatch.setattr(sys, "argv", argv)  # what the manifest records as the resume's command
    out = _RowsAsRecorded(run_dir / "records.jsonl", "dispatch.agrs")
    monkeypatch.setattr(sys, "stdout", out)
    code = main(argv[1:])
    monkeypatch.undo()
    assert code == 0, "\n".join(out.lines[-30:])
    assert any(f"resuming: {n_before} points already recorded are skipped" in line for line in out.lines), out.lines
    assert out.rows == NUM_POINTS - n_before
    assert out.first_row_at_records is not None and out.first_row_at_records < NUM_POINTS, \
        "multi-rank rows were printed only after the last point"
    recs = load_records(run_dir)
    assert sorted(r["point"] for r in recs) == list(range(NUM_POINTS))  # every point exactly once
    assert len({r["key"] for r in recs}) == NUM_POINTS
    assert all(r["status"] == "ok" for r in recs), [r.get("reason") for r in recs]
    assert (run_dir / "summary.csv").read_text().count("\n") == NUM_POINTS + 1
    assert not (run_dir / LOCK).exists()
    resumes = load_manifest(run_dir)["resumes"]
    assert len(resumes) == 1 and "--resume" in resumes[0]["command"] and resumes[0]["utc"]


def test_sigterm_of_parent_stops_ranks_and_names_the_run(tmp_path):
    rc, run_dir, n_after, text = _kill_parent_mid_run(tmp_path, signal.SIGTERM)
    assert rc == 143, text
    assert f"moebench: terminated; resume with: moebench run --resume {run_dir}" in text
    assert "Traceback" not in text
    assert not (run_dir / LOCK).exists()  # released on the way out
    assert (run_dir / "summary.csv").read_text().count("\n") == n_after + 1  # the summary of what was recorded


def test_sigint_exits_130_naming_the_run_directory(tmp_path):
    """Ctrl-C while a point is provably running (the first record is written, 30 more points of 0.5 s each to go)."""
    sweep = tmp_path / "slow.yaml"
    num_points = 32
    sweep.write_text(SINGLE.replace("iters: 2}", "iters: 100000, max_seconds: 0.5}")
                     .replace("[8, 16]", str(list(range(8, 8 * num_points + 1, 8)))))
    out = tmp_path / "runs"
    with _Run(tmp_path, [sweep, "--out", out, "--device", "cpu", "--no-plots"]) as run:
        run_dir = run.wait_for_records(out, 1)
        run.proc.send_signal(signal.SIGINT)
        rc = run.proc.wait(60)
        err = run.text()
    assert rc == 130, err
    assert f"moebench: interrupted; resume with: moebench run --resume {run_dir}" in err
    assert "Traceback" not in err
    assert 1 <= _lines(run_dir / "records.jsonl") < num_points  # it did stop the run
    assert (run_dir / "summary.csv").exists() and not (run_dir / LOCK).exists()


def _interrupt_during(tmp_path, capsys, monkeypatch, module, name, times=1):
    """`moebench run` in this process with `module.name` raising KeyboardInterrupt on its first `times` calls (a
    Ctrl-C landing there): the exit code and the one stderr line."""
    real = getattr(module, name)
    calls = []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) <= times:
            raise KeyboardInterrupt()
        return real(*a, **kw)

    monkeypatch.setattr(module, name, interrupted)
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SINGLE)
    code = main(["run", str(sweep), "--out", str(tmp_path / "runs"), "--device", "cpu"])
    assert calls, f"{name} was never called"
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return code, _one_error_line(capsys), run_dir


def test_sigint_while_plotting_exits_130_naming_the_run(tmp_path, capsys, monkeypatch):
    import moebench.plots

    code, line, run_dir = _interrupt_during(tmp_path, capsys, monkeypatch, moebench.plots, "make_plots")
    assert code == 130 and line == f"moebench: interrupted; resume with: moebench run --resume {run_dir}"
    assert len(load_records(run_dir)) == 2 and not (run_dir / LOCK).exists()


def test_sigint_while_writing_the_summary_and_again_during_the_clean_up_names_the_run(tmp_path, capsys,
                                                                                         monkeypatch):
    import moebench.run.runner

    for times in (1, 2):  # the second: Ctrl-C again while the interrupted run writes its summary
        sub = tmp_path / f"t{times}"
        sub.mkdir()
        code, line, run_dir = _interrupt_during(sub, capsys, monkeypatch, moebench.run.runner, "write_summary", times)
        assert code == 130 and line == f"moebench: interrupted; resume with: moebench run --resume {run_dir}"
        assert not (run_dir / LOCK).exists()
        monkeypatch.undo()


def test_signal_after_the_run_returned_still_exits_130_or_143_naming_it(tmp_path, capsys, monkeypatch):
    import moebench.cli

    settle = moebench.cli._Signals.settle
    for sig, code, what in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        def settle_then_signal(self, run_dir=None, sig=sig):
            settle(self, run_dir)
            signal.raise_signal(sig)  # handled before raise_signal returns: noted, not raised

        monkeypatch.setattr(moebench.cli._Signals, "settle", settle_then_signal)
        sub = tmp_path / what
        sub.mkdir()
        sweep = sub / "tiny.yaml"
        sweep.write_text(SINGLE)
        assert main(["run", str(sweep), "--out", str(sub / "runs"), "--device", "cpu", "--no-plots"]) == code
        (run_dir,) = list((sub / "runs").iterdir())
        assert _one_error_line(capsys) == f"moebench: {what}; resume with: moebench run --resume {run_dir}"
        assert len(load_records(run_dir)) == 2
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # main put the handlers back


def _tiny_run(tmp_path, capsys):
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SINGLE)
    assert main(["run", str(sweep), "--out", str(tmp_path / "runs"), "--device", "cpu", "--no-plots"]) == 0
    capsys.readouterr()
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return sweep, run_dir


def _one_error_line(capsys):
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_live_lock_refuses_resume_and_stale_lock_is_taken_over(tmp_path, capsys):
    sweep, run_dir = _tiny_run(tmp_path, capsys)
    with RunLock(run_dir):  # a live writer (this process)
        assert main(["run", "--resume", str(run_dir), "--device", "cpu"]) == 2
        line = _one_error_line(capsys)
        assert f"--resume {run_dir}: in use by pid {os.getpid()} on {platform.node()}" in line
        assert "still writing" in line
    assert "resumes" not in load_manifest(run_dir)
    # a lock file left by a dead process of this host: stale, taken over
    (run_dir / LOCK).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": platform.node(), "started_utc": "x"}))
    assert main(["run", "--resume", str(run_dir), "--device", "cpu", "--no-plots"]) == 0
    assert "resuming: 2 points already recorded" in capsys.readouterr().out
    assert len(load_records(run_dir)) == 2 and not (run_dir / LOCK).exists()
    assert len(load_manifest(run_dir)["resumes"]) == 1
    # a lock naming another host cannot be judged from here: refused, saying how to clear it
    (run_dir / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started_utc": "x"}))
    assert main(["run", "--resume", str(run_dir), "--device", "cpu"]) == 2
    assert f"delete {run_dir / LOCK}" in _one_error_line(capsys)


def test_resume_with_a_different_sweep_is_refused_naming_the_difference(tmp_path, capsys):
    sweep, run_dir = _tiny_run(tmp_path, capsys)
    assert main(["run", str(sweep), "--resume", str(run_dir), "--set", "axes.num_tokens=[8, 32]"]) == 2
    line = _one_error_line(capsys)
    assert f"--resume {run_dir}: a different sweep: axes.num_tokens: [8, 16] in the run, [8, 32] here" in line
    assert main(["run", str(sweep), "--resume", str(run_dir), "--set", "timing.iters=3"]) == 2
    assert "timing.iters: 2 in the run, 3 here" in _one_error_line(capsys)
    other = tmp_path / "other.yaml"
    other.write_text(SINGLE.replace("name: tiny", "name: other"))
    assert main(["run", str(other), "--resume", str(run_dir)]) == 2
    assert 'name: "tiny" in the run, "other" here' in _one_error_line(capsys)
    assert main(["run", "--resume", str(run_dir), "--set", "timing.iters=3"]) == 2
    assert "the stored sweep runs unchanged" in _one_error_line(capsys)
    assert len(load_records(run_dir)) == 2 and "resumes" not in load_manifest(run_dir)
    # the same sweep and --set values are fine
    assert main(["run", str(sweep), "--resume", str(run_dir), "--device", "cpu", "--no-plots"]) == 0


def test_resume_under_other_tuned_tables_is_refused(tmp_path, capsys, monkeypatch):
    """A point that names no config launches what the tuned table says: the manifest records the tables' hash, and
    a resume that would mix two tables in one run is refused like a sweep change (one line, exit 2)."""
    from moebench.kernels.runtime import tuning

    tables = tmp_path / "tables"
    tables.mkdir()
    monkeypatch.setattr(tuning, "TABLES_DIR", tables)
    sweep, run_dir = _tiny_run(tmp_path, capsys)
    assert load_manifest(run_dir)["tuned_tables"] == tuning.tables_digest(tables) == {
        "sha256": tuning.tables_digest(tables)["sha256"], "files": []}
    (tables / "cpu.json").write_text(json.dumps({"format": 1, "gpu": "cpu", "kernels": {}}))
    for given in ([], [str(sweep)]):
        assert main(["run", *given, "--resume", str(run_dir), "--device", "cpu", "--no-plots"]) == 2
        line = _one_error_line(capsys)
        assert f"--resume {run_dir}: the tuned tables changed: sha256 " in line
        assert "(no tables) in the run" in line and "(cpu.json) here" in line
    assert len(load_records(run_dir)) == 2 and "resumes" not in load_manifest(run_dir)
    # a manifest from before the tables were recorded has nothing to compare
    manifest = load_manifest(run_dir)
    del manifest["tuned_tables"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", "--resume", str(run_dir), "--device", "cpu", "--no-plots"]) == 0


def test_duplicate_records_are_counted_once(tmp_path, capsys):
    sweep, run_dir = _tiny_run(tmp_path, capsys)
    records = run_dir / "records.jsonl"
    first = records.read_text().splitlines()[0]
    with open(records, "a") as f:  # as an old concurrent writer would have left it
        f.write(first + "\n")
    assert main(["run", "--resume", str(run_dir), "--device", "cpu", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "# points: ok 2" in out
    assert (run_dir / "summary.csv").read_text().count("\n") == 3


def test_default_location_and_plots_inside_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(SINGLE)
    assert main(["run", "tiny.yaml", "--device", "cpu"]) == 0
    (run_dir,) = list((tmp_path / "results" / "runs").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "tiny.yaml"]  # no ./plots
    assert (run_dir / "plots" / "index.md").exists()
    out = capsys.readouterr().out
    assert "# plots: " in out and out.index("# plots: ") < out.index("# records: ")  # the last line names the records
    import shutil

    shutil.rmtree(run_dir / "plots")
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "index.md").exists()
    # --out moves the run and its plots together; --plots alone sends the plots to DIR/<run name>/
    assert main(["run", "tiny.yaml", "--device", "cpu", "--out", "o"]) == 0
    (moved,) = list((tmp_path / "o").iterdir())
    assert (moved / "plots" / "index.md").exists() and not (tmp_path / "plots").exists()
    assert main(["run", "tiny.yaml", "--device", "cpu", "--out", "o2", "--plots", "p"]) == 0
    (other,) = list((tmp_path / "o2").iterdir())
    assert (tmp_path / "p" / other.name / "index.md").exists() and not (other / "plots").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_watchdog_ends_a_rank_whose_parent_died_without_the_signal(tmp_path):
    """The fallback when no parent-death signal is armed: the watchdog sees the parent pid change."""
    child_code = ("import sys, time, moebench.run.dist as d; d.PR_SET_PDEATHSIG = 0; "  # option 0: prctl refuses
                  "d.die_with_parent(int(sys.argv[1])); print('armed', flush=True); time.sleep(120)")
    parent_code = ("import os, subprocess, sys, time; "
                   f"c = subprocess.Popen([sys.executable, '-c', {child_code!r}, str(os.getpid())], "
                   "stdout=subprocess.PIPE, text=True); print(c.pid, flush=True); c.stdout.readline(); "
                   "os.kill(os.getpid(), 9)")
    proc = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        proc.wait(120)
        _assert_all_gone([child], timeout_s=10.0)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
