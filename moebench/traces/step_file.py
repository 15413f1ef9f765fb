"""Per-step figures of one point in a file of their own beside the run's records: `RUN_DIR/steps/<point key>.npz`,
one column a figure (int32, float32 or float64, all of one length: the trace's steps) and a JSON `meta` mapping,
so that a record stays small however long its trace is.

    rel = write_step_columns(ctx.run_dir, point.key, {"layer_us": us, "padded_rows": rows}, {"sides": [...]})
    record["info"]["step_file"] = rel                      # "steps/<key>.npz", relative to the run directory
    columns, meta = read_step_columns(run_dir, rel)

Written atomically (a temporary file in steps/, then os.replace): a point re-run after a kill replaces its file,
so nothing is doubled, and a reader sees a whole file or none. A file whose point has no record (the run was killed
between the two) is harmless: it is replaced when the point runs again. Uncompressed .npz (numpy's zip of .npy
arrays), read back with allow_pickle=False.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np

STEPS_DIR = "steps"
COLUMN_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))
_META = "__meta__"  # the entry that holds the JSON meta; no column may take its name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def write_step_columns(run_dir: str | os.PathLike, point_key: str, columns: dict, meta: dict) -> str:
    """Write `columns` (name -> 1-D array of one of COLUMN_DTYPES, all of one length) and `meta` (JSON-ready) to
    RUN_DIR/steps/<point_key>.npz, replacing any file of that point; return its path relative to run_dir.
    ValueError for a bad name, dtype, shape or length, or meta that JSON cannot hold."""
    if not _NAME.fullmatch(point_key):
        raise ValueError(f"step file: point key {point_key!r} is not a file name ({_NAME.pattern})")
    arrays = {}
    length = None
    for name, values in columns.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"step file: column name {name!r} is not a name ({_NAME.pattern})")
        array = np.asarray(values)
        if array.dtype not in COLUMN_DTYPES or array.ndim != 1:
            raise ValueError(f"step file: column {name}: {array.dtype} of shape {array.shape}; a column is 1-D "
                             f"int32, float32 or float64")
        if length is not None and array.shape[0] != length:
            raise ValueError(f"step file: column {name}: {array.shape[0]} values, the columns before have {length}")
        length = array.shape[0]
        arrays[name] = array
    try:
        meta_text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"step file: meta is not JSON: {e}") from None
    arrays[_META] = np.array(meta_text)
    folder = Path(run_dir) / STEPS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{point_key}.npz"
    for stale in folder.glob(f".{name}.*.tmp"):  # left by a write that was killed (one writer per point)
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return f"{STEPS_DIR}/{name}"


def read_step_columns(run_dir: str | os.PathLike, relpath: str) -> tuple[dict[str, np.ndarray], dict]:
    """(columns, meta) of the step file `relpath` (as write_step_columns returned it) in run_dir. ValueError for a
    path outside run_dir/steps/; OSError when it cannot be read."""
    folder = (Path(run_dir) / STEPS_DIR).resolve()
    path = (Path(run_dir) / relpath).resolve()
    if path.parent != folder or path.suffix != ".npz":
        raise ValueError(f"step file: {relpath!r} is not a file of {STEPS_DIR}/ in {run_dir}")
    with np.load(path, allow_pickle=False) as data:
        columns = {k: data[k] for k in data.files if k != _META}
        meta = json.loads(str(data[_META])) if _META in data.files else {}
    return columns, meta
