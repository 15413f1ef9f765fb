"""`moebench tune SWEEP`: time every launch candidate of each tuned kernel at every point, write the tuned tables.

For each kernel tuned by the sweep's impls (Impl.tuned_kernel; the others, such as the torch references, are left
out), the sweep is run again with a `config` axis over the kernel's candidate table (or over the sweep's own
`config` values when it names some), through the ordinary runner: every candidate is checked against the
reference before it is timed, points run isolated, and each run directory keeps its records. Then, per (kernel, GPU
name, shape bucket) as the records name them (info.config_gpu, info.config_bucket), the candidate with the lowest
geometric mean p50 over the bucket's points wins, among the candidates checked ok at every one of those points.
The winners are merged into `<tables dir>/<GPU name>.json` (kernels._details.tuning documents the format), which
the kernels then read whenever a point names no config; each entry names its run and the Triton, torch, CUDA and
driver versions of that run's manifest (TUNED_WITH), since a launch's speed is a property of that stack.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

from moebench import registry
from moebench.kernels.runtime import tuning
from moebench.report import cells
from moebench.records import load_manifest, load_records, unique_records, write_json_atomic
from moebench.run.runner import run_sweep
from moebench.run.sweep import Sweep, SweepError, sweep_from_dict

__all__ = ["tune_sweeps", "pick_fastest", "tuned_with", "merge_table", "choice_lines", "run_tune", "TUNED_WITH"]

TUNED_WITH = ("triton", "torch", "cuda", "driver")  # the manifest env keys a table entry carries as "versions"


def tune_sweeps(sweep: Sweep) -> dict[str, Sweep]:
    """kernel -> the sweep that times its candidates (validated now, so bad input is refused before any run)."""
    by_kernel: dict[str, list[str]] = defaultdict(list)
    for name in sweep.impls:
        kernel = registry.get(name).tuned_kernel
        if kernel is not None:
            by_kernel[kernel].append(name)
    if not by_kernel:
        raise SweepError(f"{sweep.source}: impls: none of {', '.join(sweep.impls)} has launch configs to tune")
    raw = sweep.to_dict()
    given = raw["axes"].get("config", [raw["fixed"]["config"]] if "config" in raw["fixed"] else None)
    out = {}
    for kernel, impls in by_kernel.items():
        names = [c for c in given if c not in (None, "auto")] if given else list(tuning.candidates(kernel))
        if not names:
            raise SweepError(f"{sweep.source}: config: no candidate named (leave config out to time them all)")
        fixed = {k: v for k, v in raw["fixed"].items() if k != "config"}
        axes = {**{k: v for k, v in raw["axes"].items() if k != "config"}, "config": names}
        sub = dict(raw, name=f"{sweep.name}-{kernel}"[:64], impls=impls, fixed=fixed, axes=axes, headlines=[])
        out[kernel] = sweep_from_dict(sub, sweep.source)
    return out


def _point_of(rec: dict) -> str:
    """A record's point without its config: the points a bucket's candidates are compared over."""
    params = {k: v for k, v in (rec.get("params") or {}).items() if k != "config"}
    return repr((rec.get("impl"), sorted(params.items())))


def pick_fastest(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(GPU name, bucket) -> {"config", "p50_us": {candidate: geometric mean p50}, "points"} from one kernel's
    tune records; a candidate counts only where it was checked ok at every point of the bucket."""
    samples: dict = defaultdict(lambda: defaultdict(dict))  # (gpu, bucket) -> candidate -> point -> p50
    points: dict = defaultdict(set)  # (gpu, bucket) -> the points any candidate ran at
    failed: dict = defaultdict(set)  # (gpu, bucket) -> candidates wrong, failed or skipped somewhere
    for rec in records:
        info = rec.get("info") or {}
        name = (rec.get("params") or {}).get("config")
        where = (info.get("config_gpu"), info.get("config_bucket"))
        if None in where or name is None:
            continue
        points[where].add(_point_of(rec))
        p50 = (rec.get("stats") or {}).get("p50")
        if rec.get("status") == "ok" and p50:
            samples[where][name][_point_of(rec)] = p50
        else:
            failed[where].add(name)
    picks = {}
    for where, by_name in samples.items():
        means = {name: math.exp(sum(math.log(v) for v in got.values()) / len(got))
                 for name, got in by_name.items()
                 if name not in failed[where] and set(got) == points[where]}
        if means:
            picks[where] = {"config": min(means, key=means.get), "points": len(points[where]),
                            "p50_us": {n: round(us, 3) for n, us in sorted(means.items(), key=lambda kv: kv[1])}}
    return picks


def tuned_with(run_dir: Path) -> dict:
    """The versions a run was timed under (TUNED_WITH, from its manifest's env; None where one is absent)."""
    env = load_manifest(run_dir).get("env") or {}
    return {key: env.get(key) for key in TUNED_WITH}


def merge_table(tables_dir: Path, kernel: str, picks: dict, run_dir: Path) -> list[Path]:
    """Write each pick into its GPU's table under tables_dir (other kernels' and buckets' entries kept), with the
    run it came from and that run's versions."""
    written = []
    versions = tuned_with(run_dir)
    for gpu in sorted({g for g, _ in picks}):
        path = tuning.table_path(gpu, tables_dir)
        table = tuning.load_table(path) or {"format": tuning.TABLE_FORMAT, "gpu": gpu, "kernels": {}}
        entries = table["kernels"].setdefault(kernel, {})
        for (g, bucket), pick in sorted(picks.items()):
            if g == gpu:
                entries[bucket] = {**pick, "run": str(run_dir), "versions": versions}
        table["kernels"][kernel] = dict(sorted(entries.items()))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, table)
        written.append(path)
    tuning.clear_cache()
    return written


def choice_lines(picks: dict) -> list[str]:
    """The table of one kernel's winners: GPU, bucket, config, its p50 and the runner-up's, columns as wide as
    their content (a candidate's name is never cut)."""
    rows = []
    for (gpu, bucket), pick in sorted(picks.items()):
        ranked = list(pick["p50_us"].items())
        second = ranked[1] if len(ranked) > 1 else (cells.MISSING, None)
        rows.append([gpu, bucket, pick["config"], cells.us(ranked[0][1]), second[0], cells.us(second[1])])
    return cells.columns(["gpu", "bucket", "config", "p50 us", "runner-up", "runner-up p50 us"], rows)


def run_tune(sweep: Sweep, *, tables_dir: str | Path | None = None, runs_dir: str | Path, device: str | None = None,
             isolate: bool = True, out=None) -> int:
    """Tune every kernel of the sweep; print the choices. 0: all points ok; 1: some point was wrong or failed (its
    candidate is out of that bucket) or a bucket has no candidate ok everywhere."""
    out = out or sys.stdout
    tables_dir = Path(tables_dir) if tables_dir is not None else tuning.TABLES_DIR
    subs = tune_sweeps(sweep)
    code = 0
    # Every kernel is timed under the tables as they were when the tune began (a kernel launching another, as
    # fused_experts launches the alignment and the sum, sees no half-written table), and every run of this tune
    # records the same tuned_tables digest: the winners are written once all the kernels have run.
    results = []
    for i, (kernel, sub) in enumerate(subs.items()):  # the progress line names the kernel being tuned
        run_code, run_dir = run_sweep(sub, out_base=runs_dir, device=device, isolate=isolate,
                                      progress_prefix=f"tune {kernel} ({i + 1}/{len(subs)} kernels) ")
        records = unique_records(load_records(run_dir))
        picks = pick_fastest(records)
        buckets = {(r.get("info") or {}).get("config_bucket") for r in records} - {None}
        code = max(code, run_code, 1 if len(picks) < len(buckets) else 0)
        results.append((kernel, run_dir, picks, buckets))
    for kernel, run_dir, picks, buckets in results:
        paths = merge_table(tables_dir, kernel, picks, run_dir) if picks else []
        print(f"# tuned {kernel}: {len(picks)} of {len(buckets)} buckets from {run_dir}"
              + (f" -> {', '.join(map(str, paths))}" if paths else ""), file=out)
        for line in choice_lines(picks):
            print(line, file=out)
        for bucket in sorted(buckets - {b for _, b in picks}):
            print(f"# {bucket}: no candidate was checked ok at every point (nothing written)", file=out)
    return code
