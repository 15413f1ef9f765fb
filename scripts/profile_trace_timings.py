"""Where the serving trace's timing seconds go on a GPU: a trace shape's two sides (its batch, each side's pipeline
built, its first call, the whole settled timing) or a rank workload (RankTimer at growing rows), then cProfile over a
few more, at one point of sweeps/ep_step_scaling.yaml.

    python3 scripts/profile_trace_timings.py shapes [--ep-size 8]
    python3 scripts/profile_trace_timings.py ranks [--ep-size 64]

A timing's seconds beyond its samples are host work (building, compiling a new specialisation, capturing a graph):
what decides how many shapes and rank workloads a point can time in its budget (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random

import torch

from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.rank_timing import RankTimer
from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.shapes import ShapeBench
from moebench.measure.timing import wall_seconds
from moebench.params import Timing
from moebench.run.sweep import expand, load_sweep

TIMING = Timing(mode="cuda_graph", warmup=2, iters=20)


def shapes(p, dev) -> None:
    bench, built_s = wall_seconds(lambda: ShapeBench(p, dev, TIMING), dev)
    _, streams_s = wall_seconds(lambda: bench.batch(8192, 4096), dev)  # the streams, once
    print(f"bench {built_s:.2f} s, streams {streams_s:.2f} s; local experts {p.local_experts}, hidden {p.hidden}")
    rng = random.Random(0)
    for rows in (8, 16, 64, 256, 512, 1024, 2048, 4096, 8192):
        real = max(1, rows - rng.randint(0, rows // 4))
        (sp, batch), batch_s = wall_seconds(lambda: bench.batch(rows, real), dev)
        for side in SIDES:
            pipe, build_s = wall_seconds(lambda: bench.pipeline(sp, batch, side), dev)
            _, first_s = wall_seconds(pipe.run, dev)
            del pipe
            us, timing_s = wall_seconds(lambda: bench.time_side(sp, batch, side), dev)
            print(f"({rows}, {real}) {side}: batch {batch_s:.3f} s, pipeline {build_s:.3f} s, first call "
                  f"{first_s:.3f} s, settled timing {timing_s:.3f} s -> {us:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for rows, real in ((300, 280), (900, 700), (3000, 2500), (6000, 5900)):
        bench.time_shape(rows, real)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def ranks(p, dev) -> None:
    timer, built_s = wall_seconds(lambda: RankTimer(p, dev, TIMING), dev)
    print(f"timer built {built_s:.2f} s; local experts {p.local_experts}")
    rng = random.Random(0)
    experts = p.local_experts
    for rows in (1000, 8000, 30000, 74000):
        for _ in range(3):
            w = Workload(rows, tuple(min(rows // experts + rng.randint(0, 50), rows) for _ in range(experts)))
            us, timing_s = wall_seconds(lambda: timer(w), dev)
            print(f"rows {rows}: {us:.1f} us, {timing_s:.3f} s of wall")
    prof = cProfile.Profile()
    prof.enable()
    for rep in range(4):
        timer(Workload(74000, tuple(74000 // experts + 7 * rep + e for e in range(experts))))
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("shapes", "ranks"))
    ap.add_argument("--ep-size", type=int, default=None, help="default: 8 for shapes, 64 for ranks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_trace_timings: needs a CUDA GPU")
    ep = args.ep_size or (8 if args.what == "shapes" else 64)
    p = expand(load_sweep("sweeps/ep_step_scaling.yaml", [f"axes.ep_size=[{ep}]"]))[0].params
    (shapes if args.what == "shapes" else ranks)(p, torch.device("cuda"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
