"""One point on one rank: build the case, check it against the reference, time it, measure imbalance and JIT
compiles, and return its record. The runner (single process) and every rank of a multi-rank group call this."""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any, Callable

import torch

from moebench import registry
from moebench.measure.interpreted_launches import counting_interpreted_launches
from moebench.measure.gpu_state import around_timing
from moebench.measure.roofline import roofline_us
from moebench.params import Point, Timing
from moebench.registry import Case, CheckResult, RunContext
from moebench.run.sweep import Sweep


def bare_record(point: Point, sweep: Sweep, status: str, reason: str, **extra) -> dict:
    """The record of a point that did not run to a result of its own (skipped, or lost with its process)."""
    return {"point": point.index, "key": point.key, "impl": point.impl, "target": sweep.target,
            "params": point.params.to_dict(), "status": status, "reason": reason, **extra}


def interpreting() -> bool:
    """Triton kernels run in the interpreter here (imported late: importing the kernels imports triton, which
    must only happen after the CLI has set TRITON_INTERPRET)."""
    from moebench.kernels.runtime import interpreting as _interpreting

    return _interpreting()


def error_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    head = msg[-1] if msg else ""
    cuda = [ln.strip() for ln in msg if ln.strip().startswith("CUDA error:")]
    if cuda:  # torch puts its debugging hints (CUDA_LAUNCH_BLOCKING, TORCH_USE_CUDA_DSA) after the error itself
        return cuda[0][:300]
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
                  hook: Callable[[str], None] | None = None, profile_iters: int = 0) -> dict:
    """Run one point on this rank and return its record (every rank of a multi-rank point calls this).

    `hook("start"/"stop")` brackets the timed iterations; with `profile_iters` it brackets instead that many
    eager, untimed iterations run after the timing, in per-stage NVTX ranges (moebench.measure.nvtx
    .profiled_iterations): what `moebench profile` captures. The timed samples are the same either way."""
    impl = registry.get(point.impl)
    p = point.params
    timing = timing or sweep.timing
    rec: dict[str, Any] = {"point": point.index, "key": point.key, "impl": impl.name, "kernel": impl.kernel,
                           "variant": impl.variant, "target": sweep.target, "mask_aware": impl.mask_aware,
                           "twin_of": impl.twin_of, "library": impl.library, "ceiling": impl.ceiling,
                           "params": p.to_dict(), "status": "ok", "reason": "", "device": str(ctx.device),
                           "triton_interpret": interpreting()}
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
            ctx.progress(0, 3, "point phases", "build")
            case = impl.build(p, ctx)
            phases = 3 + len(case.stages) + bool(profile_iters)  # build, check, timing, each stage, profile
            ctx.progress(1, phases, "point phases", "check")
            check = case.check() if case.check is not None else CheckResult(True, "no reference check", {})
            rec["check"] = {"ok": check.ok, "detail": check.detail, "metrics": check.metrics}
            if not _all_ranks_ok(check.ok, ctx):
                rec.update(status="wrong", reason=check.detail or "another rank's check failed")
            else:
                name = f"moebench/{_stage_name(impl, case)}/{impl.name}"
                gpu_state, read_gpu_state = around_timing(ctx.device)

                def _hook(event: str) -> None:
                    nonlocal compiles_before_timed
                    if event == "start" and counter is not None:
                        compiles_before_timed = counter.count
                    read_gpu_state(event)
                    if hook and not profile_iters:
                        hook(event)

                ctx.progress(2, phases, "point phases", f"timing ({timing.iters} iterations)")
                with counting_interpreted_launches() as launches:
                    res = _measure(case.run, timing, ctx, case.graph_capturable, name, _hook)
                rec["timing_mode"] = res.mode
                if launches is not None:  # the mode column says interp only where a Triton kernel was interpreted
                    rec["interpreted_launches"] = launches[0]
                rec["timing_unroll"] = res.unroll
                if res.note:
                    rec["timing_note"] = res.note
                rec["samples_us"] = res.samples_us
                rec["stats"] = res.stats
                if ctx.is_cuda:  # clocks, temperature, power, throttle reasons at the timed region's edges
                    rec["gpu_state"] = gpu_state
                if res.ranks:
                    rec["ranks"] = {**res.ranks, "simulated": ctx.simulated}
                stages = {}
                for i, (stage_name, fn) in enumerate(case.stages):
                    ctx.progress(3 + i, phases, "point phases", f"timing stage {stage_name}")
                    sres = _measure(fn, timing, ctx, case.graph_capturable, f"moebench/{stage_name}/{impl.name}",
                                    None)
                    stages[stage_name] = {**sres.stats, "mode": sres.mode}
                if stages:
                    rec["stages"] = stages
                if profile_iters:
                    from moebench.measure.nvtx import profiled_iterations

                    ctx.progress(phases - 1, phases, "point phases", f"{profile_iters} profiled iterations")
                    rec["profile"] = profiled_iterations(case.run, case.pipeline, name, profile_iters, ctx.device,
                                                         hook)
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
    except Exception as e:  # a point that raises is recorded and the sweep goes on
        rec.update(status="failed", reason=error_line(e))
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
            r = case.routing
            if callable(r.produced) and rec["status"] == "failed":  # the kernel's output is what would be judged
                rec["imbalance_error"] = "not computed: the point failed before its kernel returned a routing"
            else:
                try:
                    from moebench.measure.imbalance import imbalance

                    rec["imbalance"] = imbalance(r.topk_ids, r.is_padding, r.num_experts, r.ep_size)
                except Exception as e:
                    rec["imbalance_error"] = error_line(e)
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
    try:
        gc.collect()
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    except Exception as e:  # an asynchronous CUDA error surfaces here: it belongs to this point
        rec["cleanup_error"] = error_line(e)
        if rec["status"] == "ok":
            rec.update(status="failed", reason=error_line(e))
    return rec


def _measure(fn, timing: Timing, ctx: RunContext, graph_capturable: bool, name: str, hook):
    from moebench.measure.timing import measure

    group = ctx.group if ctx.world_size > 1 else None
    return measure(fn, timing, ctx.device, graph_capturable=graph_capturable, range_name=name, group=group,
                   barrier=group is not None, hook=hook)
