"""Points that need several processes (dispatch paths with ep_size > 1): run them on a rank group and show each
record as rank 0 appends it.

Spawned ranks die with the runner (dist.spawn arms a parent-death signal and a watchdog), so a killed run leaves no
process appending to its records; rank 0 writes, the runner reads the new lines about once a second and prints
their rows with the progress line, as for single-rank points."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from moebench.params import Point
from moebench.registry import RunContext
from moebench.consistency import vet
from moebench.records import RECORDS, RecordWriter, load_records
from moebench.run.sweep import Sweep


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
    from moebench.run.point import bare_record

    recs = []
    for pt in points:
        rec = bare_record(pt, sweep, status, reason, **extra)
        writer.append(rec)
        recs.append(rec)
    return recs


def _in_process_group() -> bool:
    import torch.distributed as dist

    from moebench.run import dist as mdist

    return (dist.is_available() and dist.is_initialized()) or mdist.launched_by_torchrun()


class _GroupTimeout(Exception):
    pass


IN_FLIGHT = ".in_flight"  # in the run directory while a spawned group runs: the key of rank 0's current point
GIVE_UP_AFTER = 3  # rank groups in a row that failed before starting any point: the group itself cannot start


def _in_flight(run_dir: Path) -> str | None:
    try:
        return (Path(run_dir) / IN_FLIGHT).read_text().strip() or None
    except OSError:
        return None


def run_multi_rank(sweep: Sweep, points: list[Point], world: int, dev: torch.device, run_dir: Path,
                   show: Callable[[dict], None] | None = None,
                   working_on: Callable[[str], None] | None = None) -> list[dict]:
    """Run points that need `world` processes: in this process group when launched by torchrun with that world
    size, else spawned (one process per GPU, or gloo ranks on the CPU). `show(record)` is called for each record
    as it is appended. Returns the records written.

    A spawned rank group that dies (a rank killed by a signal, a lost CUDA context) or runs one point past
    `timing.point_timeout_s` (counted from the point's start, as rank 0 announces it in IN_FLIGHT) costs the point
    it was on: that point is recorded failed with the reason (unless rank 0 recorded it already) and a fresh group
    runs the rest. A group that fails before it starts a point GIVE_UP_AFTER times in a row fails the rest with its
    error. Under torchrun nothing is restarted: a crash, a hang or a lost context ends the run (`--resume`)."""
    writer = RecordWriter(run_dir)
    show = show or (lambda rec: None)
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        recs = skip_all(sweep, points, writer, f"needs {world} GPUs, {torch.cuda.device_count()} present "
                                               "(use ep_mode: simulated)")
        for rec in recs:
            show(rec)
        return recs
    from moebench.run import dist as mdist
    from moebench.run.point_worker import START_TIMEOUT_S, point_timeout_s

    keys = {pt.key for pt in points}
    tail = RecordTail(Path(run_dir) / RECORDS)
    timeout_s = point_timeout_s(sweep.timing, dev)
    in_process = _in_process_group()  # the worker runs right here (torchrun): it can call show() itself
    flight = {"key": None, "since": 0.0}

    def poll() -> None:
        for rec in tail.new():
            show(rec)
        if working_on is not None:
            working_on(f"{len(points)} points on {world} ranks")
        key, now = _in_flight(run_dir), time.monotonic()
        if key != flight["key"]:
            flight.update(key=key, since=now)
        if now - flight["since"] > (timeout_s if key else START_TIMEOUT_S):
            raise _GroupTimeout()

    todo = list(points)
    barren = 0
    while todo:
        (Path(run_dir) / IN_FLIGHT).unlink(missing_ok=True)
        flight.update(key=None, since=time.monotonic())
        try:
            mdist.run_in_world(_world_worker, world, dev.type,
                               args=(sweep.to_dict(), sweep.source, [pt.index for pt in todo], str(run_dir),
                                     show if in_process else None),
                               on_wait=None if in_process else poll)
            reason = None
        except mdist.SpawnError as e:
            reason = f"rank group failed: {str(e).splitlines()[0][:300]}"
        except _GroupTimeout:
            reason = (f"timeout after {timeout_s:g} s (rank group killed)" if flight["key"] else
                      f"the rank group started no point in {START_TIMEOUT_S:g} s (killed)")
        for rec in tail.new():
            show(rec)
        in_flight = _in_flight(run_dir)
        (Path(run_dir) / IN_FLIGHT).unlink(missing_ok=True)
        recorded = {r.get("key") for r in load_records(run_dir)}
        left = [pt for pt in todo if pt.key not in recorded]
        if reason is None or not left:
            break
        if in_flight is None:  # it failed before rank 0 started a point
            barren += 1
            if barren >= GIVE_UP_AFTER:
                for rec in skip_all(sweep, left, writer, reason, status="failed"):
                    show(rec)
                break
            continue
        barren = 0
        for rec in skip_all(sweep, [pt for pt in left if pt.key == in_flight], writer, reason, status="failed",
                            worker_restarted=True):
            show(rec)
        todo = [pt for pt in left if pt.key != in_flight]
    for rec in tail.new():
        show(rec)
    return [r for r in sorted(load_records(run_dir), key=lambda r: r.get("point", 0)) if r.get("key") in keys]


def _announce(run_dir: Path, key: str | None) -> None:
    path = Path(run_dir) / IN_FLIGHT
    tmp = path.with_name(IN_FLIGHT + ".tmp")
    tmp.write_text(key or "")
    os.replace(tmp, path)  # the runner never reads half a key


def _world_worker(ctx: RunContext, sweep_dict: dict, source: str, indices: list[int], run_dir: str,
                  show: Callable[[dict], None] | None = None) -> None:
    """Body of every rank of a multi-rank group: run the points; rank 0 announces each point (spawned groups)
    and appends the records."""
    from moebench.run import dist as mdist
    from moebench.run.point import execute_point
    from moebench.run.point_worker import context_error, with_lost_context
    from moebench.run.sweep import expand, sweep_from_dict

    sweep = sweep_from_dict(sweep_dict, source, max_points=None)  # the runner already applied the limit
    ctx = replace(ctx, run_dir=Path(run_dir).absolute())
    points = expand(sweep)
    writer = RecordWriter(Path(run_dir)) if ctx.rank == 0 else None
    announce = writer is not None and show is None  # spawned: the runner watches IN_FLIGHT
    for i in indices:
        if announce:
            _announce(Path(run_dir), points[i].key)
        rec = execute_point(points[i], sweep, ctx)
        if rec.get("status") == "failed" and mdist.is_peer_fallout(rec.get("reason", "")):
            # Another rank died under this point: the runner blames the point on that rank's death and starts
            # a fresh group for the rest (this group's connections are gone).
            raise RuntimeError(f"a peer rank failed during point {points[i].index}: {rec['reason']}")
        lost = context_error(ctx.device)
        if lost:
            with_lost_context(rec, lost, f"rank group restarted (rank {ctx.rank})")
        if writer is not None:
            writer.append(vet(rec))  # totals equal their parts, or the point is wrong naming the figure
            if show is not None:
                show(rec)
        if lost:  # this rank's group is done: spawned, the runner starts a fresh one for the rest
            raise RuntimeError(f"the CUDA context of rank {ctx.rank} was lost during point {points[i].index}: {lost}")
    if announce:
        (Path(run_dir) / IN_FLIGHT).unlink(missing_ok=True)
