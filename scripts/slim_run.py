"""Slim a finished run directory for committing it as a reference under results/ (which stays under 10 MB).

Drops what no table, compare, headline, report or plot reads back: each record's raw `samples_us` (its `stats` keep
n, p10/p50/p90, min, max, mean, cv), `jit.kernels` (the per-kernel compile keys; `jit.compiles` and
`jit.compile_s` stay), and for serving_trace records the per-shape `rank_loads` of `info.shapes` (each step's EP
excess, computed from them, stays in `info.trace_steps`). Records are rewritten with compact separators; the manifest
gets a `slimmed` entry naming what went. Idempotent; each file is replaced atomically.

    python3 scripts/slim_run.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DROPPED = ["samples_us", "jit.kernels", "info.shapes[].rank_loads (serving_trace)"]


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
    tmp.write_text(text)
    os.replace(tmp, path)


def _problem(run_dir: Path) -> str | None:
    for name in ("records.jsonl", "manifest.json"):
        if not (run_dir / name).is_file():
            return f"{run_dir}: not a run directory (no {name})"
    return None


def slim_run(run_dir: Path) -> tuple[int, int]:
    """(bytes before, bytes after) of records.jsonl."""
    records_path, manifest_path = run_dir / "records.jsonl", run_dir / "manifest.json"
    before = records_path.read_text()
    lines = [json.dumps(slim_record(json.loads(line)), separators=(",", ":"), allow_nan=False)
             for line in before.splitlines() if line.strip()]
    after = "".join(line + "\n" for line in lines)
    manifest = json.loads(manifest_path.read_text())
    manifest["slimmed"] = {"dropped": DROPPED, "by": "scripts/slim_run.py"}
    _replace(records_path, after)
    _replace(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return len(before.encode()), len(after.encode())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slim_run.py", description="Slim finished run directories for committing "
                                     "them as references (drops samples_us, jit.kernels, a trace's per-shape "
                                     "rank_loads).")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    args = parser.parse_args(argv)
    problems = [why for why in map(_problem, args.run_dirs) if why]
    if problems:  # nothing is written unless every directory is a run
        print(f"slim_run.py: {problems[0]}", file=sys.stderr)
        return 2
    for run_dir in args.run_dirs:
        before, after = slim_run(run_dir)
        print(f"{run_dir}: records {before / 1e3:.0f} -> {after / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
