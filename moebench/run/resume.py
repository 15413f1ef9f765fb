"""`--resume RUN_DIR`: the sweep comes from the run's manifest; a sweep given beside it must be that same sweep.

A resumed run that mixed two sweeps would hold points of both under one manifest (and, when the parameters differ,
new point keys that no earlier record matches): so any difference is refused, naming the first one. So is a resume
under other tuned tables (results.tuned_tables: their content hash) than the manifest records: a point that names
no config launches what the table says, so a changed table changes what the points time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moebench.records import MANIFEST, RECORDS, load_manifest
from moebench.run.results import tuned_tables
from moebench.run.sweep import Sweep, SweepError, sweep_from_dict


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj))  # tuples -> lists, as the manifest stores them


def first_difference(stored: Any, given: Any, path: str = "") -> str | None:
    """'key: <stored> in the run, <given> here' for the first differing leaf (keys in the stored order)."""
    if isinstance(stored, dict) and isinstance(given, dict):
        for k in list(stored) + [k for k in given if k not in stored]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in given:
                return f"{sub}: {json.dumps(stored[k])} in the run, absent here"
            if k not in stored:
                return f"{sub}: absent in the run, {json.dumps(given[k])} here"
            diff = first_difference(stored[k], given[k], sub)
            if diff:
                return diff
        return None
    if json.dumps(stored) != json.dumps(given):  # 1 and 1.0 differ: they make different point keys
        return f"{path or 'sweep'}: {json.dumps(stored)} in the run, {json.dumps(given)} here"
    return None


def stored_sweep(run_dir: str | Path) -> Sweep:
    """The sweep a run directory was started with (its manifest), validated again."""
    run_dir = Path(run_dir)
    opt = f"--resume {run_dir}"
    if not run_dir.is_dir():
        raise SweepError(f"{opt}: not a directory")
    manifest_path = run_dir / MANIFEST
    if not manifest_path.is_file():
        what = "a run started before its manifest was written" if (run_dir / RECORDS).exists() else "not a run"
        raise SweepError(f"{opt}: no {MANIFEST} there ({what})")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SweepError(f"{opt}: {MANIFEST} is unreadable ({str(e).splitlines()[0][:200]})") from None
    raw = manifest.get("sweep") if isinstance(manifest, dict) else None
    if not isinstance(raw, dict):
        raise SweepError(f"{opt}: {MANIFEST} holds no sweep")
    try:
        return sweep_from_dict(raw, str(manifest_path), max_points=None)
    except SweepError as e:
        raise SweepError(f"{opt}: the stored sweep no longer validates: {e}") from None


def _tables_difference(run_dir: str | Path) -> str | None:
    """'sha256 <in the run> in the run, <here> here' when the tuned tables differ from the manifest's (None for a
    manifest written before they were recorded: nothing to compare)."""
    stored = load_manifest(run_dir).get("tuned_tables")
    if not isinstance(stored, dict):
        return None
    here = tuned_tables()
    if stored.get("sha256") == here["sha256"]:
        return None
    return (f"sha256 {str(stored.get('sha256'))[:12]} ({', '.join(stored.get('files') or []) or 'no tables'}) in "
            f"the run, {here['sha256'][:12]} ({', '.join(here['files']) or 'no tables'}) here")


def check_same_sweep(run_dir: str | Path, stored: Sweep, given: Sweep | None) -> None:
    """Refuse a resume under other tuned tables than the run's, and `given` (the SWEEP argument with its
    --set) when it is not the run's own sweep."""
    diff = _tables_difference(run_dir)
    if diff:
        raise SweepError(f"--resume {run_dir}: the tuned tables changed: {diff} (resume with the run's tables)")
    if given is None:
        return
    diff = first_difference(_plain(stored.to_dict()), _plain(given.to_dict()))
    if diff:
        raise SweepError(f"--resume {run_dir}: a different sweep: {diff} (resume with the same sweep and --set "
                         "values, or leave SWEEP out to use the stored one)")
