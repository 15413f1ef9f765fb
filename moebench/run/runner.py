"""The sweep runner: for each point build the case, check it against the reference, time it, measure imbalance
and JIT compiles, append the record, print the table row. The summary and the notes under the table close a run;
the plots are the command line's (moebench.cli): the runner imports nothing of moebench.plots.

A run directory has one writer (`run_lock`), holds one record per point key (a resume skips the recorded points)
and its summary.csv is rewritten from the records at the end, also after an interrupt."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from moebench import registry
from moebench.params import Point
from moebench.registry import RunContext
from moebench.report.table import Table
from moebench.run import point_worker
from moebench.run.lock import RunLock
from moebench.run.point import execute_point, interpreting
from moebench.run.estimate import RunEstimate, estimate_lines, estimate_run
from moebench.run.progress import RunProgress
from moebench.consistency import vet
from moebench.records import RECORDS, RecordWriter, load_records, unique_records, write_summary
from moebench.measure.machine_reference import machine_reference
from moebench.run.results import (DEFAULT_RUNS_DIR, new_run_dir, record_machine_reference, record_resume,
                                   write_manifest)
from moebench.run.resume import check_same_sweep, stored_sweep
from moebench.run.sweep import Sweep, expand


def pick_device(requested: str | None) -> torch.device:
    if requested in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested not in ("cuda", "cpu") and not (requested.startswith("cuda:") and requested[5:].isdigit()):
        raise ValueError(f"--device: {requested!r} is not cuda, cuda:N or cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: no CUDA device is available here")
    if requested.startswith("cuda:") and int(requested[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {requested}: {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device(requested)


# ---------------------------------------------------------------------------------------------------------------
# Whole sweeps
# ---------------------------------------------------------------------------------------------------------------

class _Rows:
    """Prints each finished point's row once, as it finishes, with the progress line (moebench.run.progress)
    erased first: single-rank points from this process, multi-rank points as rank 0 records them."""

    def __init__(self, table: Table, progress: RunProgress):
        self.table = table
        self.progress = progress
        self.shown: set = set()

    def show(self, rec: dict) -> None:
        key = rec.get("key")
        if key in self.shown:
            return
        self.shown.add(key)
        self.progress.clear()
        self.table.row(rec)
        self.progress.point_done()

    def working_on(self, label: str) -> None:
        self.progress.start_point(label)


def _needs_world(point: Point) -> int:
    impl = registry.get(point.impl)
    p = point.params
    if impl.multi_rank and p.ep_size > 1 and p.ep_mode == "real":
        return p.ep_size
    return 1


def _param_columns(sweep: Sweep) -> list[str]:
    return [k for k in sweep.axes]


def _fixed_lines(table: Table, sweep: Sweep) -> None:
    """The sweep's fixed values above the table, each a key the run does not read marked so, and the columns of
    each trace file that the run skips."""
    from moebench.traces.csv_trace import ignored_columns_note
    from moebench.traces.knobs import TraceKnobs

    notes = TraceKnobs.unused(sweep.fixed)
    if sweep.fixed.get("trace_file") is not None:
        note = ignored_columns_note(sweep.fixed["trace_file"])
        if note:
            notes["trace_file"] = note
    for k, v in sweep.fixed.items():
        table.comment(f"  {k} = {v}" + (f"  ({notes[k]})" if k in notes else ""))
    for path in sweep.axes.get("trace_file") or []:
        note = ignored_columns_note(path) if path is not None else None
        if note:
            table.comment(f"  trace_file {path}: {note}")


def dry_run(sweep: Sweep, out=None, device: str | None = None) -> int:
    """List the points and the run's cost estimate on `device`; run nothing."""
    dev = pick_device(device)
    points = expand(sweep)
    table = Table(_param_columns(sweep), out=out, points=points)
    table.comment(f"sweep {sweep.name} ({sweep.source}): target {sweep.target}, {len(points)} points (dry run)")
    _fixed_lines(table, sweep)
    _state_estimate(table, estimate_run(points, sweep.timing, dev), sweep)
    table.header()
    for pt in points:
        table.row({"point": pt.index, "impl": pt.impl, "params": pt.params.to_dict(), "status": "planned"})
    return 0


def _state_estimate(table: Table, cost: RunEstimate, sweep: Sweep) -> None:
    """The run's cost estimate above the table; past 30 minutes a warning on stderr too."""
    lines, warning = estimate_lines(cost, sweep.sizes)
    for text in lines:
        table.comment(text)
    if warning:
        stream = getattr(table.out, "isatty", None)
        if not (stream and stream()):  # the table is kept: it says so too; on a terminal stderr's line is enough
            table.comment(f"warning: {warning}")
        sys.stderr.write(f"moebench: warning: {warning}\n")
        sys.stderr.flush()


def _torchrun_context(dev: torch.device) -> RunContext | None:
    """Under torchrun: join its process group (every rank runs `moebench run`); else None."""
    from moebench.run import dist as mdist

    if not mdist.launched_by_torchrun():
        return None
    return mdist.init_from_env("nccl" if dev.type == "cuda" else "gloo")


def _share_start(run_dir: Path | None, done: set, error: str | None, ctx: RunContext | None) -> tuple[Path, set]:
    """Rank 0 opened the run directory (or failed to); every torchrun rank needs its path and recorded keys."""
    if ctx is not None and ctx.world_size > 1:
        import torch.distributed as dist

        box = [(str(run_dir), sorted(done), error) if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=ctx.group)
        run_dir, done, error = Path(box[0][0]), set(box[0][1]), box[0][2]
        if error and ctx.rank != 0:
            raise ValueError(error)
    return run_dir, done


def _timing_line(sweep: Sweep, dev: torch.device, run_dir: Path) -> str:
    t = sweep.timing
    text = (f"timing: mode {t.mode}, warm-up {t.warmup}, iters {t.iters}, unroll {t.unroll}; p50/p10/p90 per point "
            f"in us; run dir {run_dir}")
    if dev.type != "cuda":
        text += "\ntiming: " + (f"{t.mode} needs CUDA, " if t.mode in ("cuda_graph", "events") else "") + \
            "wall clock on the CPU"
        if interpreting():
            text += "; Triton kernels in the interpreter (mode column: interp): no GPU figures"
    return text


def _open_run(sweep: Sweep, points: list[Point], dev: torch.device, out_base, resume, trun) -> tuple[Path, RunLock]:
    """The leader's run directory and its lock: a new one under `out_base`, or `resume` (its resume recorded)."""
    if resume:
        run_dir = Path(resume)
        try:
            lock = RunLock(run_dir).acquire()
        except ValueError as e:
            raise ValueError(f"--resume {e}") from None
        record_resume(run_dir)
        return run_dir, lock
    run_dir = new_run_dir(out_base, sweep.name)
    lock = RunLock(run_dir).acquire()
    write_manifest(run_dir, sweep.to_dict(), len(points), str(dev),
                   {"torchrun_world_size": trun.world_size} if trun is not None else None)
    return run_dir, lock


def run_sweep(sweep: Sweep, *, out_base: str | Path = DEFAULT_RUNS_DIR, device: str | None = None,
              resume: str | Path | None = None, end_notes: Callable[[Path], Iterable[str]] | None = None,
              out=None, isolate: bool = True, progress_prefix: str = "") -> tuple[int, Path]:
    """Run every point; return (exit code, run directory). Exit code 1 when any point was wrong or failed.

    Single-rank points run in a worker process (moebench.run.point_worker; `isolate=False`: in this process, for a
    debugger), so a point that crashes, hangs or loses the CUDA context is recorded failed and the run goes on.

    The run directory is `out_base/<sweep>-<UTC>/` (or `resume`, whose stored sweep `sweep` must equal). An
    interrupt (KeyboardInterrupt) leaves the records and a summary of them, and carries `run_dir` on the exception.
    `end_notes(run_dir)` is the caller's last step of a finished run (the command line makes the plots there):
    called on the leader after the summary, with the run directory still locked, its lines printed under the
    table before the records line.

    Launched by torchrun, every rank calls this: rank 0 owns the run directory, the table and the single-rank
    points; the multi-rank points of the torchrun world size run on all ranks; other world sizes are skipped."""
    dev = pick_device(device)
    points = expand(sweep)
    if resume:
        check_same_sweep(resume, stored_sweep(resume), sweep)
    trun = _torchrun_context(dev)
    if trun is not None:
        dev = trun.device
    leader = trun is None or trun.rank == 0
    # the machine's reference before anything else loads it (the point worker starting, below)
    start_reference = machine_reference(dev) if leader else None
    if isolate and leader and all(_needs_world(pt) == 1 for pt in points):
        # Its interpreter starts while this one opens the run (not beside timed multi-rank points: they come first).
        point_worker.prestart(dev)
    run_dir, done, lock = None, set(), None
    try:
        if leader:
            error = None
            try:
                run_dir, lock = _open_run(sweep, points, dev, out_base, resume, trun)
                record_machine_reference(run_dir, "start", start_reference)
                RecordWriter(run_dir)  # drops a torn last line before anyone reads or appends
                done = {r["key"] for r in load_records(run_dir) if "key" in r}
            except ValueError as e:
                error = str(e)
                if trun is None:
                    raise
            _share_start(run_dir, done, error, trun)
            if error:
                raise ValueError(error)
        else:
            run_dir, done = _share_start(None, set(), None, trun)
        return _run_points(sweep, points, dev, run_dir, done, trun, leader, end_notes, out, isolate,
                           progress_prefix)
    except KeyboardInterrupt as e:
        if leader and run_dir is not None:
            e.run_dir = run_dir
            try:
                write_summary(run_dir, _final_records(run_dir), _param_columns(sweep) or ["num_tokens"])
            except Exception:  # pragma: no cover - the records are what matters
                pass
        raise
    finally:
        if lock is not None:
            try:
                lock.release()
            except KeyboardInterrupt as e:  # a Ctrl-C in the release still names the run to resume
                e.run_dir = run_dir if leader else None
                raise


def _final_records(run_dir: Path) -> list[dict]:
    return sorted(unique_records(load_records(run_dir)), key=lambda r: r.get("point", 0))


def _run_points(sweep: Sweep, points: list[Point], dev: torch.device, run_dir: Path, done: set, trun,
                leader: bool, end_notes, out, isolate: bool, prefix: str) -> tuple[int, Path]:
    writer = RecordWriter(run_dir)
    table = Table(_param_columns(sweep), out=out if leader else open(os.devnull, "w"), points=points,
                  target=sweep.target)
    table.comment(f"moebench {sweep.name}: target {sweep.target}, {len(points)} points on {dev}"
                  + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
                  + (f", torchrun world of {trun.world_size}" if trun is not None else ""))
    table.comment(_timing_line(sweep, dev, run_dir))
    _fixed_lines(table, sweep)
    if done:
        table.comment(f"resuming: {len(done)} points already recorded are skipped")
    todo = [pt for pt in points if pt.key not in done]
    cost = estimate_run(todo, sweep.timing, dev)
    if leader:
        _state_estimate(table, cost, sweep)
    table.header()

    progress = RunProgress(len(todo), estimate_s=cost.total_s, prefix=prefix,
                           stream=None if leader else open(os.devnull, "w"), terminal=None if leader else False)
    rows = _Rows(table, progress)
    try:
        return _run_todo(sweep, todo, dev, run_dir, trun, leader, end_notes, table, writer, rows, isolate)
    finally:  # also on an interrupt: its message then starts a line of its own
        progress.clear()


def _run_todo(sweep: Sweep, todo: list[Point], dev: torch.device, run_dir: Path, trun, leader: bool,
              end_notes, table: Table, writer: RecordWriter, rows: _Rows, isolate: bool) -> tuple[int, Path]:
    single = [pt for pt in todo if _needs_world(pt) == 1]
    multi: dict[int, list[Point]] = {}
    for pt in todo:
        w = _needs_world(pt)
        if w > 1:
            multi.setdefault(w, []).append(pt)

    # Multi-rank points first: under torchrun the other ranks are then free to leave while rank 0 goes on.
    from moebench.run.multirank import run_multi_rank, skip_all

    restarts = 0
    for world, pts in sorted(multi.items()):
        if trun is not None and world != trun.world_size:
            if leader:
                for rec in skip_all(sweep, pts, writer, f"needs {world} ranks; torchrun started {trun.world_size}"):
                    rows.show(rec)
            continue
        rows.working_on(f"{len(pts)} points on {world} ranks")
        recs = run_multi_rank(sweep, pts, world, dev, run_dir, show=rows.show, working_on=rows.working_on)
        restarts += sum(1 for r in recs if r.get("worker_restarted"))
    if not leader:
        return 0, run_dir

    progress = rows.progress
    run_one = (_isolated_runner(sweep, dev, run_dir, progress) if isolate
               else _in_process_runner(sweep, dev, run_dir, progress))
    for pt in single:
        rows.working_on(f"point {pt.index} {pt.impl}")
        rec = run_one(pt)
        restarts += bool(rec.get("worker_restarted"))
        writer.append(vet(rec))  # totals equal their parts, or the point is wrong naming the figure
        rows.show(rec)
    progress.clear()
    record_machine_reference(run_dir, "end", machine_reference(dev))  # compare reads both ends

    records = _final_records(run_dir)
    write_summary(run_dir, records, _param_columns(sweep) or ["num_tokens"])
    table.footer(records, restarts=restarts)
    from moebench.report.headline import footer_lines  # the sweep's declared headline numbers, under the table

    for text in footer_lines(records, list(sweep.headlines)):
        table.comment(text)
    from moebench.report.trace_tax import footer_lines as tax_footer_lines  # serving_trace: the padding tax

    for text in tax_footer_lines(records):
        table.comment(text)
    from moebench.report.peers import peer_footer_lines  # each impl's p50 against the best peer at the same point

    for text in peer_footer_lines(records):
        table.comment(text)
    for text in end_notes(run_dir) if end_notes is not None else ():
        table.comment(text)
    table.comment(f"records: {run_dir / RECORDS}")
    bad = any(r.get("status") in ("wrong", "failed") for r in records)
    return (1 if bad else 0), run_dir


def _in_process_runner(sweep: Sweep, dev: torch.device, run_dir: Path, progress: RunProgress | None = None
                       ) -> Callable[[Point], dict]:
    ctx = RunContext(device=dev, run_dir=Path(run_dir).absolute(),
                     progress_sink=progress.point_report if progress is not None else None)
    return lambda pt: execute_point(pt, sweep, ctx)


def _isolated_runner(sweep: Sweep, dev: torch.device, run_dir: Path, progress: RunProgress
                     ) -> Callable[[Point], dict]:
    """Each point in the point worker; a worker that died, hung or lost its context is replaced for the next."""
    timeout_s = point_worker.point_timeout_s(sweep.timing, dev)

    cannot_start: list[str] = []
    run_token = object()  # this run's sweep, plugins and environment go to each worker once

    def run(pt: Point, retried: bool = False) -> dict:
        if cannot_start:
            return _noted(in_process(pt), f"in-process: {cannot_start[0]}")
        try:
            outcome = point_worker.get_worker(dev).run_point(pt, sweep, timeout_s, run_token, run_dir,
                                                             on_progress=progress.point_report, tick=progress.tick)
        except point_worker.WorkerGone:  # it died between points: this one has not run, a fresh worker takes it
            point_worker.drop(dev)
            if retried:
                raise
            return run(pt, retried=True)
        except point_worker.WorkerStartError as e:
            # No point ran there, so nothing is lost by running the rest here (unprotected, and said so).
            point_worker.drop(dev)
            cannot_start.append(str(e))
            print(f"moebench: {e}; the points run in this process", file=sys.stderr)
            return run(pt)
        except BaseException:  # an interrupt: the point in flight is not recorded, its worker goes with it
            point_worker.drop(dev)
            raise
        if outcome.restarted:
            point_worker.drop(dev)
        if outcome.record is None:
            return _noted(in_process(pt), "in-process: the impl is registered in the runner's process only")
        return outcome.record

    in_process = _in_process_runner(sweep, dev, run_dir, progress)
    return run


def _noted(rec: dict, isolation: str) -> dict:
    rec["isolation"] = isolation
    return rec


def check_point_index(sweep: Sweep, point_index: int) -> Point:
    """The point `--point` names, or ValueError when there is none or it needs several ranks."""
    points = expand(sweep)
    if not 0 <= point_index < len(points):
        raise ValueError(f"--point {point_index}: the sweep has points 0..{len(points) - 1}")
    pt = points[point_index]
    if _needs_world(pt) > 1:
        raise ValueError(f"--point {point_index}: needs {_needs_world(pt)} ranks; profile it under torchrun")
    return pt


def run_single_point(sweep: Sweep, point_index: int, device: str | torch.device | None, iters: int,
                     inner_hook: Callable[[str], None] | None = None) -> dict:
    """Build, check, warm up and time one point with `iters` iterations (the profiler's entry point); with
    `inner_hook`, `iters` profiled eager iterations follow, bracketed by it (execute_point's profile_iters)."""
    dev = device if isinstance(device, torch.device) else pick_device(device)
    pt = check_point_index(sweep, point_index)
    timing = replace(sweep.timing, iters=iters)
    return execute_point(pt, sweep, RunContext(device=dev), timing=timing, hook=inner_hook,
                         profile_iters=iters if inner_hook else 0)
