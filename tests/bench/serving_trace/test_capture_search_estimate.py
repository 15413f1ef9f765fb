"""What a capture-search point says while it runs: its progress line counts the shapes the plan times, not every
shape it prices."""

from pathlib import Path

import torch

from moebench.bench import capture_search
from moebench.registry import RunContext
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[3]
FAST = ["timing.iters=1", "timing.warmup=0", "timing.unroll=1"]


def test_progress_counts_the_shapes_the_plan_times():
    sweep = load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml", FAST + ["trace_shape_timings=6"],
                       size="cpu")
    (point,) = expand(sweep)
    reports = []
    ctx = RunContext(device=torch.device("cpu"), progress_sink=lambda *r: reports.append(r))
    info = capture_search.build(point.params, ctx).info
    plan = info["shape_plan"]
    assert plan["shape_times"] == "model" and plan["shape_timings"] == 6 < info["distinct_shapes"]
    assert reports and {total for _, total, what, _ in reports} == {6}
    assert [done for done, *_ in reports] == list(range(6))
