"""Slim a finished run directory for committing it as a reference under results/ (which stays under 12 MB).

Drops what no table, compare, headline, report or plot reads back: each record's raw `samples_us` (its `stats` keep
n, p10/p50/p90, min, max, mean, cv), `jit.kernels` (the per-kernel compile keys; `jit.compiles` and
`jit.compile_s` stay), for serving_trace records the per-shape `rank_loads` of `info.shapes` (each step's EP
excess, computed from them, stays in `info.trace_steps`), and the per-expert load lists of a record whose point (the
same params) has an earlier record with the very same lists, as every impl routed alike has: its
`imbalance.per_expert_real` / `per_expert_padding` give way to `imbalance.per_expert_of_point`, that record's point
index (the expert-load plots draw the records that keep them). Records are rewritten with compact separators; the manifest
gets a `slimmed` entry naming what went; the per-step files under steps/ (moebench.traces.step_file) are kept
as they are. Idempotent. Each directory is locked (a run still writing it is refused)
and every one is read and slimmed in memory before any file is replaced (each atomically): a directory that is no
run, a torn or non-JSON line, or a locked run is one line on stderr, exit 2, nothing written. For finished runs:
a slimmed run that is resumed appends whole records beside the slim ones.

    python3 scripts/slim_run.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moebench.run.lock import RunLock

DROPPED = ["samples_us", "jit.kernels", "info.shapes[].rank_loads (serving_trace)",
           "imbalance.per_expert_real/padding where an earlier record of the point has the same (per_expert_of_point)"]
PER_EXPERT = ("per_expert_real", "per_expert_padding")


def dedup_expert_loads(records: list[dict]) -> None:
    """Drop the per-expert lists a record shares with an earlier record of its point (see the module docstring)."""
    first: dict[str, list[tuple[list, int]]] = {}
    for rec in records:
        imb = rec.get("imbalance")
        if not isinstance(imb, dict) or not all(isinstance(imb.get(k), list) for k in PER_EXPERT):
            continue
        lists = [imb[k] for k in PER_EXPERT]
        seen = first.setdefault(json.dumps(rec.get("params"), sort_keys=True), [])
        same = next((point for kept, point in seen if kept == lists), None)
        if same is None:
            seen.append((lists, rec.get("point")))
        else:
            for k in PER_EXPERT:
                imb.pop(k)
            imb["per_expert_of_point"] = same


def slim_record(rec: dict) -> dict:
    rec.pop("samples_us", None)
    if isinstance(rec.get("jit"), dict):
        rec["jit"].pop("kernels", None)
    shapes = (rec.get("info") or {}).get("shapes") if rec.get("target") == "serving_trace" else None
    for shape in shapes or []:
        if isinstance(shape, dict):
            shape.pop("rank_loads", None)
    return rec


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".slim-tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def slimmed(run_dir: Path) -> tuple[str, str, int]:
    """(records text, manifest text, bytes before) of run_dir slimmed, in memory; ValueError naming what is wrong."""
    for name in ("records.jsonl", "manifest.json"):
        if not (run_dir / name).is_file():
            raise ValueError(f"{run_dir}: not a run directory (no {name})")
    try:
        before = (run_dir / "records.jsonl").read_text()
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{run_dir}: cannot read it ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{run_dir}/manifest.json: not a JSON object")
    records = []
    for n, line in enumerate(before.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            records.append((n, slim_record(rec)))
        except ValueError as e:  # a torn line (a killed run), NaN, not a record: a reference must be whole
            raise ValueError(f"{run_dir}/records.jsonl: line {n}: {e}") from None
    dedup_expert_loads([rec for _, rec in records])
    lines = []
    for n, rec in records:
        try:
            lines.append(json.dumps(rec, separators=(",", ":"), allow_nan=False))
        except ValueError as e:
            raise ValueError(f"{run_dir}/records.jsonl: line {n}: {e}") from None
    manifest["slimmed"] = {"dropped": DROPPED, "by": "scripts/slim_run.py"}
    return "".join(x + "\n" for x in lines), json.dumps(manifest, indent=2) + "\n", len(before.encode())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slim_run.py", description="Slim finished run directories for committing "
                                     "them as references (drops samples_us, jit.kernels, a trace's per-shape "
                                     "rank_loads, per-expert loads a point repeats).")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    args = parser.parse_args(argv)
    locks = []
    try:
        # every directory locked (no run may be writing it) and slimmed in memory first: nothing is written unless
        # all of them can be
        try:
            for run_dir in args.run_dirs:
                if (run_dir / "records.jsonl").is_file():
                    locks.append(RunLock(run_dir).acquire())
            done = [(run_dir, *slimmed(run_dir)) for run_dir in args.run_dirs]
        except ValueError as e:  # RunLocked is one
            print(f"slim_run.py: {e}", file=sys.stderr)
            return 2
        for run_dir, records, manifest, before in done:
            _replace(run_dir / "records.jsonl", records)
            _replace(run_dir / "manifest.json", manifest)
            print(f"{run_dir}: records {before / 1e3:.0f} -> {len(records.encode()) / 1e3:.0f} kB")
    finally:
        for lock in locks:
            lock.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
