"""The sweep runner: for each point build the case, check it against the reference, time it, measure imbalance
and JIT compiles, append the record, print the table row."""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from moebench import registry
from moebench.registry import Case, CheckResult, RunContext
from moebench.report import Table
from moebench.results import RecordWriter, load_manifest, load_records, new_run_dir, write_manifest, write_summary
from moebench.measure.roofline import roofline_us
from moebench.sweep import Point, Sweep, Timing, expand



def pick_device(requested: str | None) -> torch.device:
    if requested in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested not in ("cuda", "cpu") and not requested.startswith("cuda:"):
        raise ValueError(f"--device: {requested!r} is not cuda or cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    return torch.device(requested)


def _error_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    head = msg[-1] if msg else ""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return f"out of memory: {head[:300]}"
    name = type(e).__name__
    if "CompilationError" in name or "CompileError" in name:
        return f"compile error ({name}): {head[:300]}"
    return f"{name}: {head[:300]}"


def _stage_name(impl: registry.Impl, case: Case | None) -> str:
    return (case.nvtx_stage if case is not None and case.nvtx_stage else impl.kernel)


def _jit_counter():
    from moebench.measure.jit import JitCounter

    return JitCounter()


def _all_ranks_ok(ok: bool, ctx: RunContext) -> bool:
    """Multi-rank: every rank must agree a point is fine before anyone enters a timed collective."""
    if ctx.world_size <= 1 or ctx.group is None:
        return ok
    import torch.distributed as dist

    dev = ctx.device if dist.get_backend(ctx.group) == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def execute_point(point: Point, sweep: Sweep, ctx: RunContext, *, timing: Timing | None = None,
                  hook: Callable[[str], None] | None = None) -> dict:
    """Run one point on this rank and return its record (every rank of a multi-rank point calls this)."""
    impl = registry.get(point.impl)
    p = point.params
    timing = timing or sweep.timing
    rec: dict[str, Any] = {"point": point.index, "key": point.key, "impl": impl.name, "kernel": impl.kernel,
                           "variant": impl.variant, "target": sweep.target, "mask_aware": impl.mask_aware,
                           "twin_of": impl.twin_of, "library": impl.library,
                           "params": p.to_dict(), "status": "ok", "reason": "", "device": str(ctx.device)}
    reason = impl.available(ctx)
    if reason:
        rec.update(status="skipped", reason=reason)
        return rec

    counter = _jit_counter()
    case: Case | None = None
    compiles_before_timed = None
    t_start = time.perf_counter()
    try:
        if counter is not None:
            counter.__enter__()
        try:
            case = impl.build(p, ctx)
            check = case.check() if case.check is not None else CheckResult(True, "no reference check", {})
            rec["check"] = {"ok": check.ok, "detail": check.detail, "metrics": check.metrics}
            if not _all_ranks_ok(check.ok, ctx):
                rec.update(status="wrong", reason=check.detail or "another rank's check failed")
            else:
                name = f"moebench/{_stage_name(impl, case)}/{impl.name}"

                def _hook(event: str) -> None:
                    nonlocal compiles_before_timed
                    if event == "start" and counter is not None:
                        compiles_before_timed = counter.count
                    if hook:
                        hook(event)

                res = _measure(case.run, timing, ctx, case.graph_capturable, name, _hook)
                rec["timing_mode"] = res.mode
                rec["timing_unroll"] = res.unroll
                if res.note:
                    rec["timing_note"] = res.note
                rec["samples_us"] = res.samples_us
                rec["stats"] = res.stats
                if res.ranks:
                    rec["ranks"] = {**res.ranks, "simulated": ctx.simulated}
                stages = {}
                for stage_name, fn in case.stages:
                    sres = _measure(fn, timing, ctx, case.graph_capturable, f"moebench/{stage_name}/{impl.name}",
                                    None)
                    stages[stage_name] = {**sres.stats, "mode": sres.mode}
                if stages:
                    rec["stages"] = stages
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
    except Exception as e:  # a point that raises is recorded and the sweep goes on
        rec.update(status="failed", reason=_error_line(e))
        rec["traceback"] = traceback.format_exc(limit=8)[-4000:]
        if ctx.is_cuda:
            try:
                torch.cuda.synchronize(ctx.device)
            except Exception:
                pass

    if counter is not None:
        summary = counter.summary()
        if compiles_before_timed is not None and summary.get("supported", True):
            summary["timed_region_compiles"] = counter.count - compiles_before_timed
        rec["jit"] = summary
    if case is not None:
        rec["bytes"] = int(case.bytes_moved)
        rec["flops"] = int(case.flops)
        if case.bytes_note:
            rec["bytes_note"] = case.bytes_note
        rec["info"] = dict(case.info)
        if case.routing is not None:
            try:
                from moebench.measure.imbalance import imbalance

                r = case.routing
                rec["imbalance"] = imbalance(r.topk_ids, r.is_padding, r.num_experts, r.ep_size)
            except Exception as e:
                rec["imbalance_error"] = _error_line(e)
        stats = rec.get("stats") or {}
        p50 = stats.get("p50")
        if p50 and p50 > 0 and rec["status"] == "ok":
            rec["gbps"] = case.bytes_moved / p50 / 1e3 if case.bytes_moved else None
            rec["tflops"] = case.flops / p50 / 1e6 if case.flops else None
            if ctx.is_cuda and (case.bytes_moved or case.flops or case.roofline_us):
                roof = case.roofline_us if case.roofline_us is not None else roofline_us(case.flops, case.bytes_moved)
                rec["roofline_us"] = roof
                rec["roof_fraction"] = roof / p50
        if case.cleanup is not None:
            try:
                case.cleanup()
            except Exception:
                pass
    rec["wall_s"] = round(time.perf_counter() - t_start, 3)
    del case
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    return rec


def _measure(fn, timing: Timing, ctx: RunContext, graph_capturable: bool, name: str, hook):
    from moebench.measure.timing import measure

    group = ctx.group if ctx.world_size > 1 else None
    return measure(fn, timing, ctx.device, graph_capturable=graph_capturable, range_name=name, group=group,
                   barrier=group is not None, hook=hook)


# ---------------------------------------------------------------------------------------------------------------
# Whole sweeps
# ---------------------------------------------------------------------------------------------------------------

class _Progress:
    """A one-line progress indicator on stderr when it is a terminal (the table goes to stdout)."""

    def __init__(self, total: int):
        self.total = total
        self.enabled = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, done: int, label: str) -> None:
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        eta = el / done * (self.total - done) if done else 0.0
        sys.stderr.write(f"\r[{done:>4}/{self.total}] {el:6.0f}s elapsed, ~{eta:5.0f}s left  {label[:50]:<50}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def _needs_world(point: Point) -> int:
    impl = registry.get(point.impl)
    p = point.params
    if impl.multi_rank and p.ep_size > 1 and p.ep_mode == "real":
        return p.ep_size
    return 1


def _param_columns(sweep: Sweep) -> list[str]:
    return [k for k in sweep.axes]


def dry_run(sweep: Sweep, out=None) -> int:
    points = expand(sweep)
    table = Table(_param_columns(sweep), out=out)
    table.comment(f"sweep {sweep.name} ({sweep.source}): target {sweep.target}, {len(points)} points (dry run)")
    for k, v in sweep.fixed.items():
        table.comment(f"  {k} = {v}")
    table.header()
    for pt in points:
        table.row({"point": pt.index, "impl": pt.impl, "params": pt.params.to_dict(), "status": "planned"})
    return 0


def _torchrun_context(dev: torch.device) -> RunContext | None:
    """Under torchrun: join its process group (every rank runs `moebench run`); else None."""
    from moebench import dist as mdist

    if not mdist.launched_by_torchrun():
        return None
    return mdist.init_from_env("nccl" if dev.type == "cuda" else "gloo")


def _share_run_dir(run_dir: Path | None, ctx: RunContext | None) -> Path:
    """Rank 0 made the run directory; every torchrun rank needs its path."""
    if ctx is None or ctx.world_size == 1:
        return run_dir
    import torch.distributed as dist

    box = [str(run_dir) if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return Path(box[0])


def run_sweep(sweep: Sweep, *, out_base: str | Path = "results", device: str | None = None,
              resume: str | Path | None = None, make_plots: bool = True, plots_base: str | Path = "plots",
              out=None) -> tuple[int, Path]:
    """Run every point; return (exit code, run directory). Exit code 1 when any point was wrong or failed.

    Launched by torchrun, every rank calls this: rank 0 owns the run directory, the table and the single-rank
    points; the multi-rank points of the torchrun world size run on all ranks; other world sizes are skipped."""
    dev = pick_device(device)
    points = expand(sweep)
    trun = _torchrun_context(dev)
    if trun is not None:
        dev = trun.device
    leader = trun is None or trun.rank == 0
    run_dir = None
    if resume:
        run_dir = Path(resume)
        manifest = load_manifest(run_dir)
        if not manifest:
            raise ValueError(f"--resume {run_dir}: no manifest.json there")
        if manifest.get("sweep", {}).get("name") != sweep.name:
            raise ValueError(f"--resume {run_dir}: that run is of sweep {manifest.get('sweep', {}).get('name')!r}, "
                             f"not {sweep.name!r}")
    elif leader:
        run_dir = new_run_dir(out_base, sweep.name)
        write_manifest(run_dir, sweep.to_dict(), len(points), str(dev),
                       {"torchrun_world_size": trun.world_size} if trun is not None else None)
    run_dir = _share_run_dir(run_dir, trun)
    writer = RecordWriter(run_dir)
    done = {r["key"] for r in load_records(run_dir) if "key" in r}

    table = Table(_param_columns(sweep), out=out if leader else open(os.devnull, "w"))
    table.comment(f"moebench {sweep.name}: target {sweep.target}, {len(points)} points on {dev}"
                  + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
                  + (f", torchrun world of {trun.world_size}" if trun is not None else ""))
    table.comment(f"timing: mode {sweep.timing.mode}, warm-up {sweep.timing.warmup}, iters {sweep.timing.iters}"
                  f", unroll {sweep.timing.unroll}; p50/p10/p90 per point in us; run dir {run_dir}")
    for k, v in sweep.fixed.items():
        table.comment(f"  {k} = {v}")
    if done:
        table.comment(f"resuming: {len(done)} points already recorded are skipped")
    table.header()

    todo = [pt for pt in points if pt.key not in done]
    single = [pt for pt in todo if _needs_world(pt) == 1]
    multi: dict[int, list[Point]] = {}
    for pt in todo:
        w = _needs_world(pt)
        if w > 1:
            multi.setdefault(w, []).append(pt)

    # Multi-rank points first: under torchrun the other ranks are then free to leave while rank 0 goes on.
    for world, pts in sorted(multi.items()):
        if trun is not None and world != trun.world_size:
            if leader:
                for rec in _skip_all(sweep, pts, writer, f"needs {world} ranks; torchrun started {trun.world_size}"):
                    table.row(rec)
            continue
        for rec in run_multi_rank(sweep, pts, world, dev, run_dir):
            if leader:
                table.row(rec)
    if not leader:
        return 0, run_dir

    progress = _Progress(len(single))
    ctx = RunContext(device=dev)
    for n_done, pt in enumerate(single):
        progress.update(n_done, pt.impl)
        rec = execute_point(pt, sweep, ctx)
        writer.append(rec)
        progress.close()
        table.row(rec)
    progress.close()

    records = sorted(load_records(run_dir), key=lambda r: r.get("point", 0))
    write_summary(run_dir, records, _param_columns(sweep) or ["num_tokens"])
    table.footer(records)
    from moebench.headline import footer_lines  # the sweep's declared headline numbers, under the table

    for text in footer_lines(records, list(sweep.headlines)):
        table.comment(text)
    from moebench.peers import peer_footer_lines  # each impl's p50 against the best peer at the same point

    for text in peer_footer_lines(records):
        table.comment(text)
    if make_plots:
        try:
            from moebench.plots import make_plots as _make_plots

            paths = _make_plots(run_dir, Path(plots_base) / run_dir.name)
            table.comment(f"plots: {len(paths)} written to {Path(plots_base) / run_dir.name}")
        except Exception as e:
            table.comment(f"plots not made: {_error_line(e)}")
    table.comment(f"records: {run_dir / 'records.jsonl'}")
    bad = any(r.get("status") in ("wrong", "failed") for r in records)
    return (1 if bad else 0), run_dir


def _skip_all(sweep: Sweep, points: list[Point], writer: RecordWriter, reason: str,
              status: str = "skipped") -> list[dict]:
    recs = []
    for pt in points:
        rec = {"point": pt.index, "key": pt.key, "impl": pt.impl, "target": sweep.target,
               "params": pt.params.to_dict(), "status": status, "reason": reason}
        writer.append(rec)
        recs.append(rec)
    return recs


def run_multi_rank(sweep: Sweep, points: list[Point], world: int, dev: torch.device, run_dir: Path) -> list[dict]:
    """Run points that need `world` processes: in this process group when launched by torchrun with that world
    size, else spawned (one process per GPU, or gloo ranks on the CPU). Returns the records written. A rank group
    that dies (a crash, a hang past its deadline) fails its unrecorded points with the error and the sweep goes on."""
    writer = RecordWriter(run_dir)
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        return _skip_all(sweep, points, writer, f"needs {world} GPUs, {torch.cuda.device_count()} present "
                                                "(use ep_mode: simulated)")
    from moebench import dist as mdist

    keys = {pt.key for pt in points}
    try:
        mdist.run_in_world(_world_worker, world, dev.type, args=(sweep.to_dict(), sweep.source,
                                                                [pt.index for pt in points], str(run_dir)))
    except mdist.SpawnError as e:
        recorded = {r.get("key") for r in load_records(run_dir)}
        _skip_all(sweep, [pt for pt in points if pt.key not in recorded], writer,
                  f"rank group failed: {str(e).splitlines()[0][:300]}", status="failed")
    return [r for r in sorted(load_records(run_dir), key=lambda r: r.get("point", 0)) if r.get("key") in keys]


def _world_worker(ctx: RunContext, sweep_dict: dict, source: str, indices: list[int], run_dir: str) -> None:
    """Body of every rank of a multi-rank group: run the points; rank 0 appends the records."""
    from moebench.sweep import sweep_from_dict

    sweep = sweep_from_dict(sweep_dict, source)
    points = expand(sweep)
    writer = RecordWriter(Path(run_dir)) if ctx.rank == 0 else None
    for i in indices:
        rec = execute_point(points[i], sweep, ctx)
        if writer is not None:
            writer.append(rec)


def run_single_point(sweep: Sweep, point_index: int, device: str | torch.device | None, iters: int,
                     inner_hook: Callable[[str], None] | None = None) -> dict:
    """Build, check, warm up and time one point with `iters` iterations (the profiler's entry point)."""
    dev = device if isinstance(device, torch.device) else pick_device(device)
    points = expand(sweep)
    if not 0 <= point_index < len(points):
        raise ValueError(f"--point {point_index}: the sweep has points 0..{len(points) - 1}")
    pt = points[point_index]
    if _needs_world(pt) > 1:
        raise ValueError(f"--point {point_index}: needs {_needs_world(pt)} ranks; profile it under torchrun")
    timing = replace(sweep.timing, iters=iters)
    return execute_point(pt, sweep, RunContext(device=dev), timing=timing, hook=inner_hook)
