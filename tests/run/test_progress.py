"""What a user sees while a run goes: the progress line (run-level estimate, a point's own progress relayed from the
point worker, one line on a terminal, a line every 30 s in a log) and the interrupt message on a line of its own."""

from __future__ import annotations

import io
import re

from moebench.cli import main
from moebench.registry import RunContext
from moebench.run import progress as progress_mod
from moebench.run.progress import RunProgress, throttled
from moebench.run.runner import run_sweep
from moebench.run.sweep import sweep_from_dict


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_no_zero_estimate_before_a_point_ends_then_the_measured_rate():
    clock = Clock()
    bare = RunProgress(4, stream=io.StringIO(), terminal=True, clock=clock)
    bare.start_point("point 0 x.triton")
    clock.now += 50
    assert "~0s left" not in bare.line() and "no estimate before the first point ends" in bare.line()
    guessed = RunProgress(4, estimate_s=400, stream=io.StringIO(), terminal=True, clock=clock)
    clock.now += 100
    assert "~5m00s left (estimated)" in guessed.line()
    guessed.point_done()  # one of four in 100 s: 300 s left, measured
    assert "~5m00s left" in guessed.line() and "estimated" not in guessed.line()
    late = RunProgress(2, estimate_s=60, stream=io.StringIO(), terminal=True, clock=clock)
    late.start_point("point 0 serving_trace.layer")
    clock.now += 600  # ten times the estimate and the first point still going: no "~0s left"
    assert "~0s" not in late.line() and "past the estimate of 1m00s" in late.line()


def test_a_points_own_progress_is_shown_with_its_estimate():
    clock = Clock()
    p = RunProgress(2, stream=io.StringIO(), terminal=True, clock=clock)
    p.start_point("point 0 layer.masked")
    p.point_report(0, 4, "trace shapes", "rows 64")
    clock.now += 30
    p.point_report(1, 4, "trace shapes", "rows 128")
    line = p.line()
    assert "layer.masked: trace shapes 1/4 (rows 128), ~1m30s left in it" in line, line
    assert "30s in this point" in line
    # a quarter of the only point counts toward the run's estimate once a point has ended
    p.point_done()
    p.start_point("point 1 layer.masked")
    p.point_report(2, 4, "trace shapes")
    assert "[1/2]" in p.line() and "left" in p.line()


def test_terminal_redraws_one_line_and_a_log_gets_a_line_every_30_s():
    clock = Clock()
    tty = Tty()
    p = RunProgress(3, stream=tty, clock=clock)
    p.start_point("point 0 a")
    clock.now += 1
    p.point_report(1, 2, "steps")
    assert "\n" not in tty.getvalue() and tty.getvalue().count("\r") == 2
    p.clear()
    assert tty.getvalue().endswith("\r")  # the line erased: what is written next starts a clean line

    log = io.StringIO()
    p = RunProgress(3, stream=log, terminal=False, clock=clock)
    p.start_point("point 0 a")
    p.point_report(1, 10, "steps")
    assert log.getvalue() == ""
    clock.now += progress_mod.REPORT_EVERY_S
    p.tick()
    (line,) = log.getvalue().splitlines()
    assert line.startswith("moebench: [0/3]") and "steps 1/10" in line
    p.tick()
    assert len(log.getvalue().splitlines()) == 1


def test_context_progress_is_a_no_op_outside_a_run_and_throttled_in_the_worker():
    import torch

    RunContext(device=torch.device("cpu")).progress(1, 2, "x")  # nothing to send it to: no error
    clock = Clock()
    sent = []
    report = throttled(lambda *r: sent.append(r), clock=clock, every_s=0.5)
    for i in range(5):  # the same series, only done moving: the first, then at most one per 0.5 s, and the last
        report(i, 5, "steps")
    report(5, 5, "steps")
    assert [r[0] for r in sent] == [0, 5]
    report(1, 3, "ranks", "rank 1")
    report(2, 3, "ranks", "rank 2")  # a new detail always goes
    assert [r[:1] + r[3:] for r in sent[2:]] == [(1, "rank 1"), (2, "rank 2")]


def _ep_sim_sweep():
    return sweep_from_dict({"name": "p", "target": "layer", "impls": ["ep_sim.experts"],
                            "fixed": {"ep_mode": "simulated", "ep_size": 2, "num_tokens": 8, "hidden": 32,
                                      "intermediate": 16, "num_experts": 4, "top_k": 2},
                            "timing": {"warmup": 0, "iters": 1}})


def test_ep_sim_progress_is_relayed_from_the_point_worker(tmp_path, monkeypatch):
    reports = []
    original = RunProgress.point_report

    def record(self, done, total, what, detail=""):
        reports.append((done, total, what, detail))
        original(self, done, total, what, detail)

    monkeypatch.setattr(RunProgress, "point_report", record)
    code, _ = run_sweep(_ep_sim_sweep(), out_base=tmp_path, device="cpu", out=io.StringIO())
    assert code == 0
    assert (0, 2, "simulated ranks timed", "rank 0") in reports and (2, 2, "simulated ranks timed", "") in reports
    phases = [r[3] for r in reports if r[2] == "point phases"]
    assert phases[:3] == ["build", "check", "timing (1 iterations)"]


def test_the_interrupt_message_starts_a_line_of_its_own(tmp_path, monkeypatch):
    from moebench.run import point

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    monkeypatch.setattr(point, "execute_point", interrupted)
    monkeypatch.setattr("moebench.run.runner.execute_point", interrupted)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\ntarget: router\nimpls: [topk_softmax.torch]\n"
                     "fixed: {num_tokens: 8, num_experts: 8, top_k: 2}\ntiming: {warmup: 0, iters: 1}\n")
    code = main(["run", str(sweep), "--device", "cpu", "--in-process", "--no-plots", "--out", str(tmp_path / "r")])
    assert code == 130
    err = tty.getvalue()
    assert "[0/1]" in err  # the progress line was drawn
    shown = err.split("\r")[-1]  # what the terminal shows last, from the start of a line
    assert shown.startswith("moebench: interrupted; resume with:"), repr(err[-300:])


def test_a_points_own_estimate_never_counts_up():
    """Between two reports the rate alone (time taken / done) grows with the wait: the line counts down instead."""
    clock = Clock()
    p = RunProgress(1, stream=io.StringIO(), terminal=True, clock=clock)
    p.start_point("point 0 layer.masked")
    p.point_report(0, 8, "rank workloads")
    clock.now += 10
    p.point_report(1, 8, "rank workloads")
    shown = []
    for _ in range(12):  # the next report is late: 60 s with no word
        shown.append(p.line().split("left in it")[0].rsplit("~", 1)[1])
        clock.now += 5
    p.point_report(2, 8, "rank workloads")  # a slower rate than the first: still no higher than the last shown
    shown.append(p.line().split("left in it")[0].rsplit("~", 1)[1])
    seconds = [int(m or 0) * 60 + int(s) for m, s in (re.fullmatch(r"(?:(\d+)m)?(\d+)s ", x).groups() for x in shown)]
    assert seconds[0] == 70 and all(b <= a for a, b in zip(seconds, seconds[1:])), shown
    assert seconds[-2] == 15 and seconds[-1] <= 15, shown
    clock.now += 600  # the count-down runs out with work left: said, not "~0s left in it"
    assert "~0s" not in p.line() and "longer than its rate so far said" in p.line()
