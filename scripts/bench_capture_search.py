"""Time the capture-list search (moebench.traces.capture_search) on a long trace: a day of steps written by
scripts/make_trace.py (1,000,000 steps, DP 2, the chat mix up to 2048 tokens by default), its distinct steps, the
priced table (every (real count, candidate) pair of one DP rank priced once: the price is a plain layer-like stand-in
here, 5 us + 0.7 us a row + 1.3 us a real row per call, so what is timed is the search's own arithmetic, not a
timer's), and the exact search for every K from 1 to --max-k. Wall times through moebench.measure (mode wall).

    python3 scripts/bench_capture_search.py --steps 1000000 --max-k 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from moebench.measure.timing import measure
from moebench.params import Timing
from moebench.traces.capture_search import EngineShape, price_trace, search
from moebench.traces.csv_trace import read_trace_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_trace  # noqa: E402  (scripts/make_trace.py, beside this one)

ONCE = Timing(mode="wall", warmup=0, iters=1, unroll=1)


def _stand_in(real: int, rows: int) -> float:
    return 5.0 + 0.7 * rows + 1.3 * real


def _eager(real: int, rows: int) -> float:
    return _stand_in(real, rows) + 9 * 2.98  # nine launches at the eager-over-graph cost


def _wall_s(fn) -> float:
    return measure(fn, ONCE, torch.device("cpu")).stats["p50"] / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--distribution", default="chat")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--max-k", type=int, default=64)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.csv")
        make_trace.main([path, "--steps", str(args.steps), "--dp-size", str(args.dp_size), "--distribution",
                         args.distribution, "--max-tokens", str(args.max_tokens)])
        got: dict = {}
        read_s = _wall_s(lambda: got.update(d=read_trace_file(path).distinct_steps(args.dp_size)))
    d = got["d"]
    engine = EngineShape(args.dp_size)
    price_s = _wall_s(lambda: got.update(p=price_trace(d.table(), d.counts, engine, _stand_in, _eager)))
    priced = got["p"]
    k_max = min(args.max_k, priced.candidates.size)
    search_s = _wall_s(lambda: got.update(r=search(priced, list(range(1, k_max + 1)))))
    res = got["r"]
    print(f"trace: {d.num_steps:,} steps, {len(d.steps):,} distinct, {priced.candidates.size} candidate sizes; "
          f"{torch.get_num_threads()} CPU threads")
    print(f"read + distinct steps   {read_s:8.2f} s")
    print(f"priced table            {price_s:8.2f} s  ({priced.candidates.size} x {priced.candidates.size}, "
          f"method {res.method})")
    print(f"search, K = 1..{k_max:<6}  {search_s:8.2f} s  (curve computed to K={len(res.curve)}; within 1% of "
          f"every size captured at K={res.within_bound_k})")
    print(f"search after the timings {price_s + search_s:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
