"""Points that need several processes (dispatch paths with ep_size > 1): run them on a rank group and show each
record as rank 0 appends it.

Spawned ranks die with the runner (dist.spawn arms a parent-death signal and a watchdog), so a killed run leaves no
process appending to its records; rank 0 writes, the runner reads the new lines about once a second and prints
their rows with the progress line, as for single-rank points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from moebench.registry import RunContext
from moebench.results import RECORDS, RecordWriter, load_records
from moebench.sweep import Point, Sweep


class RecordTail:
    """The complete lines appended to records.jsonl since the last call (the file only grows while locked)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


def skip_all(sweep: Sweep, points: list[Point], writer: RecordWriter, reason: str,
             status: str = "skipped") -> list[dict]:
    recs = []
    for pt in points:
        rec = {"point": pt.index, "key": pt.key, "impl": pt.impl, "target": sweep.target,
               "params": pt.params.to_dict(), "status": status, "reason": reason}
        writer.append(rec)
        recs.append(rec)
    return recs


def _in_process_group() -> bool:
    import torch.distributed as dist

    from moebench import dist as mdist

    return (dist.is_available() and dist.is_initialized()) or mdist.launched_by_torchrun()


def run_multi_rank(sweep: Sweep, points: list[Point], world: int, dev: torch.device, run_dir: Path,
                   show: Callable[[dict], None] | None = None,
                   working_on: Callable[[str], None] | None = None) -> list[dict]:
    """Run points that need `world` processes: in this process group when launched by torchrun with that world
    size, else spawned (one process per GPU, or gloo ranks on the CPU). `show(record)` is called for each record
    as it is appended. Returns the records written. A rank group that dies (a crash, a hang past its deadline)
    fails its unrecorded points with the error and the sweep goes on."""
    writer = RecordWriter(run_dir)
    show = show or (lambda rec: None)
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        recs = skip_all(sweep, points, writer, f"needs {world} GPUs, {torch.cuda.device_count()} present "
                                               "(use ep_mode: simulated)")
        for rec in recs:
            show(rec)
        return recs
    from moebench import dist as mdist

    keys = {pt.key for pt in points}
    tail = RecordTail(Path(run_dir) / RECORDS)

    def poll() -> None:
        for rec in tail.new():
            show(rec)
        if working_on is not None:
            working_on(f"{len(points)} points on {world} ranks")

    in_process = _in_process_group()  # the worker runs right here (torchrun): it can call show() itself
    try:
        mdist.run_in_world(_world_worker, world, dev.type,
                           args=(sweep.to_dict(), sweep.source, [pt.index for pt in points], str(run_dir),
                                 show if in_process else None),
                           on_wait=None if in_process else poll)
    except mdist.SpawnError as e:
        recorded = {r.get("key") for r in load_records(run_dir)}
        skip_all(sweep, [pt for pt in points if pt.key not in recorded], writer,
                 f"rank group failed: {str(e).splitlines()[0][:300]}", status="failed")
    for rec in tail.new():
        show(rec)
    return [r for r in sorted(load_records(run_dir), key=lambda r: r.get("point", 0)) if r.get("key") in keys]


def _world_worker(ctx: RunContext, sweep_dict: dict, source: str, indices: list[int], run_dir: str,
                  show: Callable[[dict], None] | None = None) -> None:
    """Body of every rank of a multi-rank group: run the points; rank 0 appends the records."""
    from moebench.point import execute_point
    from moebench.sweep import expand, sweep_from_dict

    sweep = sweep_from_dict(sweep_dict, source, max_points=None)  # the runner already applied the limit
    points = expand(sweep)
    writer = RecordWriter(Path(run_dir)) if ctx.rank == 0 else None
    for i in indices:
        rec = execute_point(points[i], sweep, ctx)
        if writer is not None:
            writer.append(rec)
            if show is not None:
                show(rec)
