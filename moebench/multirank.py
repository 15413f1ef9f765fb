"""Points that need several processes (dispatch paths with ep_size > 1): run them on a rank group and show each
record as rank 0 appends it.

Spawned ranks die with the runner (dist.spawn arms a parent-death signal and a watchdog), so a killed run leaves no
process appending to its records; rank 0 writes, the runner reads the new lines about once a second and prints
their rows with the progress line, as for single-rank points."""

from __future__ import annotations

import json
import os
import time
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
             status: str = "skipped", **extra) -> list[dict]:
    recs = []
    for pt in points:
        rec = {"point": pt.index, "key": pt.key, "impl": pt.impl, "target": sweep.target,
               "params": pt.params.to_dict(), "status": status, "reason": reason, **extra}
        writer.append(rec)
        recs.append(rec)
    return recs


def _in_process_group() -> bool:
    import torch.distributed as dist

    from moebench import dist as mdist

    return (dist.is_available() and dist.is_initialized()) or mdist.launched_by_torchrun()


class _PointTimeout(Exception):
    pass


GIVE_UP_AFTER = 3  # rank groups in a row that recorded nothing: the group itself cannot start


def run_multi_rank(sweep: Sweep, points: list[Point], world: int, dev: torch.device, run_dir: Path,
                   show: Callable[[dict], None] | None = None,
                   working_on: Callable[[str], None] | None = None) -> list[dict]:
    """Run points that need `world` processes: in this process group when launched by torchrun with that world
    size, else spawned (one process per GPU, or gloo ranks on the CPU). `show(record)` is called for each record
    as it is appended. Returns the records written.

    A spawned rank group that dies (a rank killed by a signal, a lost CUDA context) or runs one point past
    `timing.point_timeout_s` costs the point it was on (the first one not yet recorded): that point is recorded
    failed with the reason and a fresh group runs the rest. After GIVE_UP_AFTER groups in a row that recorded
    nothing, the rest fail with the error (a group that cannot start)."""
    writer = RecordWriter(run_dir)
    show = show or (lambda rec: None)
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        recs = skip_all(sweep, points, writer, f"needs {world} GPUs, {torch.cuda.device_count()} present "
                                               "(use ep_mode: simulated)")
        for rec in recs:
            show(rec)
        return recs
    from moebench import dist as mdist
    from moebench.point_worker import point_timeout_s

    keys = {pt.key for pt in points}
    tail = RecordTail(Path(run_dir) / RECORDS)
    timeout_s = point_timeout_s(sweep.timing, dev)
    in_process = _in_process_group()  # the worker runs right here (torchrun): it can call show() itself
    last_progress = [time.monotonic()]

    def poll() -> None:
        new = tail.new()
        if new:
            last_progress[0] = time.monotonic()
        for rec in new:
            show(rec)
        if working_on is not None:
            working_on(f"{len(points)} points on {world} ranks")
        if time.monotonic() - last_progress[0] > timeout_s:
            raise _PointTimeout()

    todo = list(points)
    barren = 0
    while todo:
        last_progress[0] = time.monotonic()
        try:
            mdist.run_in_world(_world_worker, world, dev.type,
                               args=(sweep.to_dict(), sweep.source, [pt.index for pt in todo], str(run_dir),
                                     show if in_process else None),
                               on_wait=None if in_process else poll)
            reason = None
        except mdist.SpawnError as e:
            reason = f"rank group failed: {str(e).splitlines()[0][:300]}"
        except _PointTimeout:
            reason = f"timeout after {timeout_s:g} s (rank group killed)"
        for rec in tail.new():
            show(rec)
        recorded = {r.get("key") for r in load_records(run_dir)}
        left = [pt for pt in todo if pt.key not in recorded]
        if reason is None or not left:
            break
        barren = barren + 1 if len(left) == len(todo) else 1
        if barren >= GIVE_UP_AFTER:
            for rec in skip_all(sweep, left, writer, reason, status="failed"):
                show(rec)
            break
        for rec in skip_all(sweep, left[:1], writer, reason, status="failed", worker_restarted=True):
            show(rec)
        todo = left[1:]
    for rec in tail.new():
        show(rec)
    return [r for r in sorted(load_records(run_dir), key=lambda r: r.get("point", 0)) if r.get("key") in keys]


def _world_worker(ctx: RunContext, sweep_dict: dict, source: str, indices: list[int], run_dir: str,
                  show: Callable[[dict], None] | None = None) -> None:
    """Body of every rank of a multi-rank group: run the points; rank 0 appends the records."""
    from moebench import dist as mdist
    from moebench.point import execute_point
    from moebench.point_worker import context_error
    from moebench.sweep import expand, sweep_from_dict

    sweep = sweep_from_dict(sweep_dict, source, max_points=None)  # the runner already applied the limit
    points = expand(sweep)
    writer = RecordWriter(Path(run_dir)) if ctx.rank == 0 else None
    for i in indices:
        rec = execute_point(points[i], sweep, ctx)
        if rec.get("status") == "failed" and mdist.is_peer_fallout(rec.get("reason", "")):
            # Another rank died under this point: the runner blames the point on that rank's death and starts
            # a fresh group for the rest (this group's connections are gone).
            raise RuntimeError(f"a peer rank failed during point {points[i].index}: {rec['reason']}")
        lost = context_error(ctx.device)
        if lost:  # a sticky CUDA error: this rank's group is done; the runner starts a fresh one for the rest
            rec.update(status="failed", worker_restarted=True,
                       reason="; ".join(x for x in (rec.get("reason") or f"CUDA error: {lost}",
                                                    f"the CUDA context of rank {ctx.rank} was lost, rank group "
                                                    "restarted") if x))
        if writer is not None:
            writer.append(rec)
            if show is not None:
                show(rec)
        if lost and not mdist.launched_by_torchrun():  # under torchrun the run ends with the rank
            os._exit(3)
