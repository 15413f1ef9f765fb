"""Reading a run directory's files: the record and manifest readers, below run/, report/, plots/ and the library
packages, so that anything which reads a finished run (the wire model's calibration in moebench.dispatch, the
reports) can without importing the runner. Writing them is moebench.run.results's job, which re-exports these."""

from __future__ import annotations

import json
from pathlib import Path

RECORDS = "records.jsonl"
MANIFEST = "manifest.json"


def load_records(run_dir: str | Path) -> list[dict]:
    """Every record of the run, in file order; a torn last line (a killed run) is skipped."""
    path = Path(run_dir) / RECORDS
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from a killed run
    return out


def load_manifest(run_dir: str | Path) -> dict:
    """The run's manifest.json, {} when there is none."""
    path = Path(run_dir) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}
