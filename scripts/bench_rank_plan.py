"""How long the EP rank plan takes on the host (which workloads to time, the rounds, the record), its timer stood in
by a cost formula so only the plan's own work is measured: what a GPU run pays between its timings.

    python3 scripts/bench_rank_plan.py [--contests 2000] [--ranks 64] [--experts 6] [--budget 256]

The contests are drawn from a stated distribution (seeded): each contest is one micro-batch of `--ranks` EP ranks,
each rank's routes per local expert Poisson around a mean drawn from 50..3000, its rows 0.8 x its routes; a
million-step trace reads 4,000 steps, two sides each (ep_measure.COLLECT_STEPS). Trees from before rank_plan.py
kept plan_rank_times in rank_cost.py: the script reads either, so the same command measures before and after.
Figures: docs/benchmarks.md#the-ep-step-and-what-a-trace-costs.
"""

from __future__ import annotations

import argparse

import numpy as np

try:
    from moebench.bench.serving_trace.rank_plan import Contest, plan_rank_times
except ImportError:  # a tree from before the split
    from moebench.bench.serving_trace.rank_cost import Contest, plan_rank_times
from moebench.bench.serving_trace.launch import Launch
from moebench.bench.serving_trace.rank_cost import Workload


def contests_of(n: int, ranks: int, experts: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        loads = []
        for _ in range(ranks):
            counts = rng.poisson(rng.integers(50, 3000), size=experts)
            rows = max(int(counts.sum() * 0.8), int(counts.max()), 1)
            loads.append(Workload(rows, tuple(int(c) for c in counts)))
        out.append(Contest(1, tuple(loads)))
    return out


def launch_of(rows: int) -> Launch:
    return Launch("small", 64) if rows < 2000 else Launch("large", 128, True)


def stand_in(w: Workload) -> float:
    """A rank's microseconds as a formula (the GPU's timing is not what this measures)."""
    return 5.0 + 0.01 * sum(w.counts) + 0.3 * sum(1 for c in w.counts if c) + 0.001 * w.rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contests", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    contests = contests_of(args.contests, args.ranks, args.experts)
    _, rec = plan_rank_times(contests, stand_in, args.budget, launch_of, 0.03)  # its record states its wall time
    print(f"# {args.contests} contests x {args.ranks} ranks, {args.experts} local experts, budget {args.budget}")
    print(f"plan {rec.wall_s:.1f} s: {rec.rank_times}, {rec.rank_timings} timed of {rec.distinct_workloads} distinct, "
          f"{rec.decisive_rounds} decisive rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
