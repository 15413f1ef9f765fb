"""Where sweeps come from and where runs go: the bundled sweeps (a checkout's sweeps/ or the installed package's
moebench/_sweeps/, each with its scenarios/ folder) and the check of an output folder before anything is written
there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from moebench.run.sweep import SweepError

_PACKAGE = Path(__file__).resolve().parent.parent  # moebench/, above run/


def bundled_sweep_dir() -> Path | None:
    """sweeps/ of a checkout (or an editable install), else the copy a wheel installs as moebench/_sweeps/."""
    for d in (_PACKAGE.parent / "sweeps", _PACKAGE / "_sweeps"):
        if d.is_dir() and any(d.glob("*.yaml")):
            return d
    return None


def bundled_sweeps() -> list[Path]:
    """The top-level sweeps, then the scenarios (sweeps/scenarios/*.yaml); their names do not collide."""
    d = bundled_sweep_dir()
    return sorted(d.glob("*.yaml")) + sorted(d.glob("scenarios/*.yaml")) if d else []


def resolve_sweep_path(arg: str) -> str:
    """A path, or the name of a bundled sweep or scenario (`quickstart` -> sweeps/quickstart.yaml, `topk6` ->
    sweeps/scenarios/topk6.yaml)."""
    if Path(arg).exists():
        return arg
    for p in bundled_sweeps():
        if p.stem == arg or p.name == arg:
            return str(p)
    return arg


def check_output_dir(option: str, path: str | os.PathLike) -> Path:
    """Refuse (SweepError, one line) a folder that cannot hold output: a file, a path under a file, a place this
    process cannot write. Creates nothing that stays: a probe file in the nearest existing folder is removed."""
    path = Path(path)
    head = f"{option} {path}"
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise SweepError(f"{head}: {existing} is a dangling symbolic link")
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise SweepError(f"{head}: not a directory" if existing == path else f"{head}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SweepError(f"{head}: {existing} is not writable")
    try:  # root passes os.access everywhere; a read-only mount still refuses the probe
        fd, probe = tempfile.mkstemp(prefix=".moebench-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SweepError(f"{head}: cannot write in {existing} ({e.strerror})") from None
    return path
