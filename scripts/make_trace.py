"""Write a serving trace CSV drawn from one of moebench's seeded distributions (moebench.traces.distributions), for
benchmarks that need a trace longer than a sweep should draw at every run (a day of steps): one column for every DP
rank alike (`num_tokens`), or one column per DP rank, each rank drawn from its own stream (`dp0,dp1,...`), as
serving_trace's `trace_distribution` draws them. The same arguments write the same file.

    python3 scripts/make_trace.py OUT.csv --steps 1000000 --dp-size 2 --distribution prefill_heavy --max-tokens 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from moebench.traces.distributions import SERVING_MIXES, rank_tokens

DISTRIBUTIONS = (*SERVING_MIXES, "uniform", "decode_prefill", "lognormal")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the CSV to write (replaced atomically)")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--dp-size", type=int, default=2, help="columns: one per DP rank")
    ap.add_argument("--same-counts", action="store_true",
                    help="one `num_tokens` column (every DP rank the same counts) instead of one per DP rank")
    ap.add_argument("--distribution", default="prefill_heavy", choices=DISTRIBUTIONS)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "dp_size", "max_tokens"):
        if getattr(args, name) < 1:
            print(f"make_trace: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        print(f"make_trace: {args.out}: its directory does not exist", file=sys.stderr)
        return 2
    columns = 1 if args.same_counts else args.dp_size
    streams = [rank_tokens(args.distribution, args.steps, args.max_tokens, args.seed, r) for r in range(columns)]
    header = "num_tokens" if args.same_counts else ",".join(f"dp{r}" for r in range(columns))
    out_dir = os.path.dirname(os.path.abspath(args.out))
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".csv.tmp")
    with os.fdopen(fd, "w") as f:
        f.write(f"# {args.steps} steps, {args.distribution} up to {args.max_tokens} tokens, seed {args.seed}, "
                f"{'one column for every DP rank' if args.same_counts else 'one column per DP rank'}\n")
        f.write(header + "\n")
        f.writelines(",".join(map(str, row)) + "\n" for row in zip(*streams))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
