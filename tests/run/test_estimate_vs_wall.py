"""The run's cost estimate (the start line and `--dry-run`) within a factor of two of the wall time, for every bundled
sweep (sweeps/*.yaml and sweeps/scenarios/*.yaml) on the CPU: at its `--size cpu` where it declares one, else at
its own size.

Running every sweep would take many minutes, so each sweep's wall time was measured once and committed beside this
file (estimate_wall_times.json: `moebench run SWEEP [--size cpu] --device cpu --no-plots`, the whole command, on
a 2-core CPU machine shared with other work, at the commit it names). The test compares today's estimate with that
figure, and runs for real (and times) only the sweeps measured under QUICK_S. The estimate is for an unloaded
machine; each wall time comes with the machine's slowdown measured beside it (tests/run/machine_speed.py: a
reference interpreter call against its estimate), so the window is [wall / (2 x slowdown), 2 x wall]: the plain
factor of two on an unloaded machine, wider by what the load was. A sweep whose measuring run was stopped (at
75 s, or at the 480 s cap) holds a lower bound only (`wall_s_at_least`, with the reason): its estimate must still
reach the lower side of that window, and where the entry lists the points that finished before the stop
(`points_done`, their summed `points_wall_s` from the run's records) their estimate is held to the window of that
partial wall. A new bundled sweep has no entry: measure it and add one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.run.machine_speed import slowdown

from moebench.cli import main
from moebench import registry
from moebench.run.estimate import estimate_run, point_s
from moebench.run.paths import bundled_sweeps
from moebench.run.progress import duration
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[2]
MEASURED = json.loads((Path(__file__).with_name("estimate_wall_times.json")).read_text())
QUICK_S = 4.5  # measured under this: run for real here too (one sweep today, about 5 s)
FACTOR = 2.0
SWEEPS = sorted(str(p.relative_to(ROOT)) for p in bundled_sweeps())


def _size(path: str) -> str | None:
    return "cpu" if "cpu" in load_sweep(ROOT / path).sizes else None


def _estimate(path: str, capsys) -> float:
    """The estimate in seconds, as `--dry-run` prints it (checked against the module's own figure)."""
    size = _size(path)
    sweep = load_sweep(ROOT / path, size=size)
    est = estimate_run(expand(sweep), sweep.timing, torch.device("cpu")).total_s
    assert main(["run", str(ROOT / path), *(["--size", size] if size else []), "--device", "cpu", "--dry-run"]) == 0
    (shown,) = re.findall(r"# estimate: ~(\S+) for \d+ points", capsys.readouterr().out)
    assert shown == duration(est)
    return est


def test_every_bundled_sweep_is_measured():
    missing = [path for path in SWEEPS if path not in MEASURED["sweeps"]]
    assert not missing, f"no measured wall time for {missing}: measure each once and add it to the JSON"


@pytest.mark.parametrize("path", SWEEPS)
def test_the_estimate_is_within_2x_of_the_wall_time(path, capsys, tmp_path):
    entry = MEASURED["sweeps"].get(path)
    if entry is None:
        pytest.skip("not measured (test_every_bundled_sweep_is_measured fails)")
    if "wall_s" not in entry:
        pytest.skip(f"a lower bound only: {entry.get('stopped') or entry.get('over_a_minute')}")
    est = _estimate(path, capsys)
    wall, load = entry["wall_s"], entry["slowdown"]
    if wall < QUICK_S:  # cheap enough to run here: today's wall time and load, not the committed ones
        size = _size(path)
        before = slowdown()
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "moebench", "run", str(ROOT / path),
                               *(["--size", size] if size else []), "--device", "cpu", "--no-plots",
                               "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
        wall = time.monotonic() - start
        load = (before + slowdown()) / 2
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
    low = wall / (FACTOR * max(load, 1.0))
    assert low <= est <= wall * FACTOR, \
        f"{path}: estimate {est:.1f} s, wall {wall:.1f} s at slowdown {load:.2f} (window {low:.1f}-{wall * FACTOR:.1f} s)"


@pytest.mark.parametrize("path", [p for p in SWEEPS if "wall_s_at_least" in MEASURED["sweeps"].get(p, {})])
def test_a_stopped_sweep_is_estimated_over_its_lower_bound(path, capsys):
    """The skipped sweeps ran past `wall_s_at_least` (the measuring run was stopped there): their estimate reaches
    the lower side of the window at least."""
    entry = MEASURED["sweeps"][path]
    assert _estimate(path, capsys) >= entry["wall_s_at_least"] / (FACTOR * max(entry["slowdown"], 1.0))


@pytest.mark.parametrize("path", [p for p in SWEEPS if "points_done" in MEASURED["sweeps"].get(p, {})])
def test_a_stopped_sweep_s_finished_points_are_estimated_within_2x(path):
    """The points a stopped run finished (their records' own wall times, summed) against their estimates: the
    factor of two checked on the part of the sweep that was measured."""
    entry = MEASURED["sweeps"][path]
    sweep = load_sweep(ROOT / path, size=_size(path))
    points, cpu = expand(sweep), torch.device("cpu")
    ctx = registry.RunContext(cpu)
    est = sum(point_s(points[i], sweep.timing, cpu) for i in entry["points_done"]
              if registry.get(points[i].impl).available(ctx) is None)  # an impl that cannot run here costs nothing
    wall, load = entry["points_wall_s"], entry["slowdown"]
    low = wall / (FACTOR * max(load, 1.0))
    assert low <= est <= wall * FACTOR, \
        f"{path}: finished points estimated {est:.1f} s, took {wall:.1f} s at slowdown {load:.2f} " \
        f"(window {low:.1f}-{wall * FACTOR:.1f} s)"
