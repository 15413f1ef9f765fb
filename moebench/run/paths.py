"""Where things come from and where runs go: the bundled sweeps (a checkout's sweeps/ or the installed package's
moebench/_sweeps/, each with its scenarios/ folder), the paths a sweep names (resolve_sweep_path: beside the sweep
file, then the current directory, then the bundled data; the sweep loader resolves every path key of the knob
groups (their PATHS) and `plugins:` entry with resolve_param_paths and plugin_entry), and the check of an output folder before anything is
written there."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any



class PathError(ValueError):
    """A path that cannot be used. str() is the one line shown to the user (exit 2)."""


class SweepPathError(PathError):
    """A path a sweep names that cannot be used: `key` names where (fixed.trace_file, axes.trace_file[1],
    plugins[0]); str() is the reason."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key = key



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


def sweep_argument_path(arg: str) -> str:
    """The SWEEP argument of a command: a path, or the name of a bundled sweep or scenario (`quickstart` ->
    sweeps/quickstart.yaml, `topk6` -> sweeps/scenarios/topk6.yaml)."""
    if Path(arg).exists():
        return arg
    for p in bundled_sweeps():
        if p.stem == arg or p.name == arg:
            return str(p)
    return arg


def sweep_path_candidates(value: str, sweep_dir: str | os.PathLike | None,
                          bundled_dir: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """Where `value` (a path a sweep names) is looked for, in order, as (place, path): an absolute path is itself;
    a relative one is looked for beside the sweep file (sweep_dir; None for a sweep that is no file), then in the
    current directory, then, for a bare file name, among the bundled files of bundled_dir."""
    path = Path(value)
    if path.is_absolute():
        return [("", path)]
    places = []
    if sweep_dir is not None:
        here = Path(os.path.abspath(sweep_dir))
        places.append((f"beside the sweep ({here})", here / path))
    cwd = Path(os.getcwd())
    if sweep_dir is None or Path(os.path.abspath(sweep_dir)) != cwd:
        places.append((f"in the current directory ({cwd})", cwd / path))
    if bundled_dir is not None and len(path.parts) == 1:
        places.append((f"bundled with moebench ({Path(bundled_dir)})", Path(bundled_dir) / path))
    return places


def find_sweep_path(value: str, sweep_dir: str | os.PathLike | None,
                    bundled_dir: str | os.PathLike | None = None, *, directory: bool = False) -> str | None:
    """The absolute path of the first existing file (a folder, with `directory`) of sweep_path_candidates, or
    None."""
    for _, path in sweep_path_candidates(value, sweep_dir, bundled_dir):
        if path.is_dir() if directory else path.is_file():
            return os.path.abspath(path)
    return None


def resolve_sweep_path(value: str, sweep_dir: str | os.PathLike | None,
                       bundled_dir: str | os.PathLike | None = None, *, directory: bool = False) -> str:
    """The absolute path of the file a sweep means by `value` (the order of sweep_path_candidates: beside the sweep,
    the current directory, the bundled files), or PathError naming where it looked. The sweep loader stores the
    result in the sweep, so a run resumed from another directory finds the same file."""
    found = find_sweep_path(value, sweep_dir, bundled_dir, directory=directory)
    if found is not None:
        return found
    what = "directory" if directory else "file"
    places = [place for place, _ in sweep_path_candidates(value, sweep_dir, bundled_dir)]
    if places == [""]:
        raise PathError(f"{value}: no such {what}")
    if bundled_dir is not None and len(Path(value).parts) == 1:
        known = ", ".join(sorted(p.name for p in Path(bundled_dir).iterdir() if p.is_file())) or "none"
        places[-1] = places[-1][:-1] + f": {known})"
    where = places[0] if len(places) == 1 else ", ".join(places[:-1]) + " or " + places[-1]
    raise PathError(f"{value}: no such {what} {where}")


def check_output_dir(option: str, path: str | os.PathLike) -> Path:
    """Refuse (PathError, one line) a folder that cannot hold output: a file, a path under a file, a place this
    process cannot write. Creates nothing that stays: a probe file in the nearest existing folder is removed."""
    path = Path(path)
    head = f"{option} {path}"
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise PathError(f"{head}: {existing} is a dangling symbolic link")
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise PathError(f"{head}: not a directory" if existing == path else f"{head}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PathError(f"{head}: {existing} is not writable")
    try:  # root passes os.access everywhere; a read-only mount still refuses the probe
        fd, probe = tempfile.mkstemp(prefix=".moebench-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PathError(f"{head}: cannot write in {existing} ({e.strerror})") from None
    return path


def resolve_param_paths(fixed: dict, axes: dict, sweep_dir: Path | None,
                        paths: dict[str, tuple[Path | None, bool]]) -> tuple[dict, dict]:
    """fixed and axes with every path key's value made the absolute path of its file (docs/sweeps.md#paths-in-a-
    sweep); `paths`: key -> (the folder of the files bundled with moebench or None, whether it names a directory),
    the knob groups' PATHS. A file found nowhere is refused (SweepPathError) naming where it was looked for."""
    fixed, axes = dict(fixed), dict(axes)
    for key, (bundled, directory) in paths.items():
        for section, table in (("fixed", fixed), ("axes", axes)):
            if key not in table:
                continue
            values = table[key] if section == "axes" else [table[key]]
            resolved = []
            for i, value in enumerate(values):
                try:
                    resolved.append(None if value is None else resolve_sweep_path(
                        value, sweep_dir, bundled, directory=directory))
                except PathError as e:
                    where = f"{section}.{key}" + (f"[{i}]" if section == "axes" else "")
                    raise SweepPathError(where, str(e)) from None
            table[key] = resolved if section == "axes" else resolved[0]
    return fixed, axes


def plugin_entry(entry: Any, i: int, sweep_dir: Path | None) -> Any:
    """A `plugins:` entry (the i-th) as the sweep keeps it: a module found as a file beside the sweep or in the
    current directory (`mod` -> mod.py or mod/__init__.py, `pkg.mod` -> pkg/mod.py ...), or a path to a .py file,
    becomes that file's absolute path; a module found only on sys.path (an installed one) stays a name."""
    if not isinstance(entry, str) or not entry:
        return entry  # load_plugins refuses it, naming the entry
    if entry.endswith(".py") or "/" in entry or "\\" in entry:
        try:
            return resolve_sweep_path(entry, sweep_dir)
        except PathError as e:
            raise SweepPathError(f"plugins[{i}]", str(e)) from None
    stem = entry.replace(".", "/")
    for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
        found = find_sweep_path(candidate, sweep_dir)
        if found is not None:
            return found
    try:
        installed = importlib.util.find_spec(entry.split(".")[0]) is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        places = [place for place, _ in sweep_path_candidates(f"{stem}.py", sweep_dir)]
        raise SweepPathError(f"plugins[{i}]", f"no plugin module {entry!r} ({stem}.py or {stem}/__init__.py) "
                                              f"{', '.join(places)} or on sys.path")
    return entry
