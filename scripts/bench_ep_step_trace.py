"""How long a long serving trace's EP step takes on the host: a trace written by scripts/make_trace.py (1,000,000
steps by default, one column per DP rank or one for all), run through sweeps/ep_step_scaling.yaml at one EP size in
this process, then the phases the record states (routing, shapes, rank workloads, replay, host composition), the
point's wall time as the record states it and the process's peak memory (its maximum resident set).

    python3 scripts/bench_ep_step_trace.py [--steps 1000000] [--columns 2] [--ep-size 64] [--size cpu] [--keep DIR]

On the CPU (`--size cpu`) the shapes and rank workloads are timed in Triton's interpreter (a handful each); the
host phases are what this measures. Figures: docs/benchmarks.md#the-ep-step-and-what-a-trace-costs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--columns", type=int, choices=(1, 2), default=2,
                    help="2: one column per DP rank (drawn apart); 1: every DP rank the same counts")
    ap.add_argument("--ep-size", type=int, default=64)
    ap.add_argument("--num-experts", type=int, default=128, help="at --size cpu (the preset's at the GPU size)")
    ap.add_argument("--size", default="cpu", help="the sweep's size (cpu, or '' for its full size on a GPU)")
    ap.add_argument("--distribution", default="prefill_heavy")
    ap.add_argument("--keep", help="keep the trace and the run under this directory")
    args = ap.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moebench-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = work / f"trace-{args.steps}-{args.columns}col.csv"
    gen = [sys.executable, str(ROOT / "scripts" / "make_trace.py"), str(trace), "--steps", str(args.steps),
           "--distribution", args.distribution, "--dp-size", "2"] + (["--same-counts"] if args.columns == 1 else [])
    subprocess.run(gen, check=True)
    cmd = [sys.executable, "-m", "moebench", "run", str(ROOT / "sweeps" / "ep_step_scaling.yaml"), "--out",
           str(work / "runs"), "--no-plots", "--in-process", "--set", f"axes.ep_size=[{args.ep_size}]",
           "--set", "trace_replay=0", "--set", f"trace_file={trace}"]
    if args.size:
        cmd += ["--size", args.size, "--set", f"num_experts={args.num_experts}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        return run.returncode
    run_dir = sorted((work / "runs").iterdir())[-1]
    rec = json.loads((run_dir / "records.jsonl").read_text().splitlines()[-1])
    info = rec["info"]
    phases = info["phase_wall_s"]
    print(f"# {args.steps} steps, {args.columns} column(s), {info['trace']['distinct_steps']} distinct steps, "
          f"EP {args.ep_size}, size {args.size or 'full'}, cores {os.cpu_count()}")
    print("# " + "  ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    print(f"routing + host composition {phases.get('routing', 0) + phases.get('host_composition', 0):.1f} s, "
          f"the point {info['trace_wall_s']:.1f} s, peak memory {peak_gib:.2f} GiB, run {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
