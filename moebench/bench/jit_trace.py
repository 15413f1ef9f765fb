"""The `jit_trace` target: how often the fixed-capacity dispatch kernels recompile over a trace of batch sizes.

`jit_trace.a2a_fixed` replays a sequence of per-step batch sizes through the `a2a_fixed` pack and combine Triton
kernels (moebench.dispatch.pack), whose `CAPACITY` is a tl.constexpr: every distinct capacity is one new
variant of each kernel. The capacity of a step follows the point's `capacity_policy` (pack.CapacityKnobs,
pack.capacity_for):
  exact  the step's max rows per destination rank,
  pow2   its next power of two, capped at the buffer (num_max_tokens_per_rank rows per destination),
  max    always the buffer.
The step's max rows per destination comes from real routing of that step's batch: inputs.make_batch (num_tokens =
the step's batch size, seed_offset = the step) routed with p.num_experts / p.top_k, masked when p.mask, over
p.ep_size destination ranks. So padding that is not masked raises the exact capacity (padded rows are sent too).
Only this rank's batch decides the capacity (a real EP group would take the max over source ranks: slightly larger
capacities, the same kind of count).

One process, no collective: the all-to-all is a loopback (the send blocks are read straight back by the combine
kernel, as with world size 1), since the kernels around it are what recompile. Compiles are counted per step with
measure.jit.JitCounter (triton.knobs.runtime hooks) on FRESH copies of the two kernels (measure.jit.fresh_kernel:
an empty in-memory cache, whatever ran before in this process). A fresh copy still finds variants that
any earlier process built in Triton's on-disk cache: each step says how many of its compiles were disk-cache loads.

Batch sizes (traces.knobs.TraceKnobs): trace when given, else trace_steps sizes drawn from trace_distribution
(seeded by p.seed) in [1, trace_max_tokens]: uniform, decode_prefill, lognormal or a serving mix (chat, mixed,
prefill_heavy: DP rank 0's stream), all of moebench.traces.distributions.

The record's `info`: trace_steps [{step, batch, max_rows, capacity, compiles, compile_s, disk_cache_hits}] with
`compiles` the new capacity variants compiled at that step (compile events of the pack kernel; the combine kernel
must compile exactly as often, which check() verifies) and `compile_s` / `disk_cache_hits` over both kernels;
predicted_compiles (the number of distinct capacities: exact = distinct step maxima, pow2 = distinct capped powers
of two, max = 1), predicted_cumulative (distinct capacities seen up to each step), observed_compiles, and more.
Under TRITON_INTERPRET=1 (or without a GPU) the hooks never fire: counts are None / "unsupported" and check()
verifies the capacity sequence and the prediction only, saying so.

The timed region (`run`) is one replay of the last step's pack + combine (already compiled).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import torch

from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.check import compare_close, compare_exact, poison
from moebench.dispatch.base import EPLayout, effective_ids, token_in_rank
from moebench.dispatch.pack import (
    COMBINE_FIXED_KERNEL,
    PACK_FIXED_KERNEL,
    CapacityKnobs,
    capacity_for,
    combine_fixed,
    combine_fixed_torch,
    pack_fixed,
    pack_fixed_torch,
    send_positions,
)
from moebench.kernels.runtime import interpreting
from moebench.measure.jit import JitCounter, fresh_kernel, triton_cache_dir, unsupported_reason
from moebench.params import Params
from moebench.measure.cost import INTERP_PROGRAM_S, STEP_INPUTS_S, TRITON_COMPILE_S, DeviceRates, PointWork
from moebench.registry import Case, CheckResult, Routing, RunContext, declare_work, register_impl
from moebench.traces.distributions import batch_sizes
from moebench.traces.knobs import TraceKnobs

PACK_KERNEL = PACK_FIXED_KERNEL.fn.__name__  # compile events are matched by the kernels' names
COMBINE_KERNEL = COMBINE_FIXED_KERNEL.fn.__name__


# ---------------------------------------------------------------------------------------------------------------
# The trace and the policies
# ---------------------------------------------------------------------------------------------------------------

def trace_batch_sizes(p: Params) -> list[int]:
    """The per-step batch sizes of a point: its trace as given, else drawn (seeded) from its trace_distribution."""
    t = p.knobs(TraceKnobs)
    if t.trace is not None:
        return [int(b) for b in t.trace]
    return batch_sizes(t.trace_distribution, t.trace_steps, t.trace_max_tokens, p.seed)


def trace_source(p: Params) -> str:
    """Where the point's batch sizes come from: "explicit" (its trace), else the distribution they are drawn from."""
    t = p.knobs(TraceKnobs)
    return "explicit" if t.trace is not None else t.trace_distribution


def predicted_cumulative(capacities: list[int]) -> list[int]:
    """Distinct capacities seen up to and including each step: one compile per new CAPACITY value."""
    seen: set[int] = set()
    out = []
    for c in capacities:
        seen.add(int(c))
        out.append(len(seen))
    return out


def pow2_bound(buffer_rows: int) -> int:
    """Most variants the pow2 policy can ever need: 1, 2, 4, ... up to the buffer (ceil(log2(buffer)) + 1)."""
    return math.ceil(math.log2(buffer_rows)) + 1 if buffer_rows > 1 else 1


def capacity_problem(policy: str, max_rows: int, capacity: int, buffer_rows: int) -> str | None:
    """Why `capacity` is not what `policy` gives for a step whose max rows per destination is `max_rows`."""
    need = max(1, max_rows)
    if capacity < need:
        return f"capacity {capacity} < max rows {need} (rows would be dropped)"
    if capacity > buffer_rows:
        return f"capacity {capacity} > buffer {buffer_rows}"
    if policy == "exact" and capacity != need:
        return f"exact: capacity {capacity} != max rows {need}"
    if policy == "pow2":
        if capacity != buffer_rows and (capacity & (capacity - 1) or capacity >= 2 * need):
            return f"pow2: capacity {capacity} is not the next power of two of {need} (nor the buffer)"
        if capacity == buffer_rows and 1 << (need - 1).bit_length() < buffer_rows:
            return f"pow2: capacity {capacity} is the buffer although {1 << (need - 1).bit_length()} fits"
    if policy == "max" and capacity != buffer_rows:
        return f"max: capacity {capacity} != buffer {buffer_rows}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------------------------

def step_inputs(p: Params, step: int, batch: int, device: torch.device) -> dict[str, Any]:
    """The step's batch routed over p.ep_size destinations: rows, effective ids, weights, send positions,
    max rows per destination."""
    from moebench import inputs

    sp = replace(p, num_tokens=int(batch), trace=None)
    b = inputs.make_batch(sp, device, seed_offset=step)
    topk_weights, topk_ids = inputs.route(sp, b)  # -1 on padded rows when p.mask
    ids = effective_ids(topk_ids, b.mask)
    layout = EPLayout.of(p)
    send_pos, counts = send_positions(token_in_rank(ids, layout))
    max_rows = int(counts.max().item()) if counts.numel() else 0
    # fresh, offset-0 copies: pointer alignment is part of a Triton specialisation and must not vary per step
    return {"x": b.hidden.clone(), "ids": ids.clone(), "weights": topk_weights.float().clone(),
            "send_pos": send_pos.clone(),
            "counts": counts, "max_rows": max_rows, "is_padding": b.is_padding, "global_ids": topk_ids}


class _Buffers:
    """The fixed send buffer (num_max_tokens_per_rank rows per destination), allocated once: a step with
    capacity c uses its first R*c rows, so block d starts at row d*c as the kernels expect."""

    def __init__(self, p: Params, device: torch.device):
        R, K, rows = p.ep_size, p.top_k, p.ep_size * p.knobs(CapacityKnobs).num_max_tokens_per_rank
        self.ep_size = R
        self.send_x = torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=device)
        self.send_meta = torch.empty(rows, 2 * K + 1, dtype=torch.int32, device=device)

    def views(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.ep_size * capacity
        return self.send_x[:n], self.send_meta[:n]


def _launch(step: dict, bufs: _Buffers, out: torch.Tensor, capacity: int, local_experts: int,
            kernels: tuple[Any, Any] | None, use_triton: bool) -> None:
    """Pack the step's rows into the capacity-`capacity` blocks, then combine them straight back (loopback)."""
    send_x, send_meta = bufs.views(capacity)
    if use_triton:
        pack_fixed(step["x"], step["send_pos"], step["ids"], step["weights"], send_x, send_meta, capacity,
                   local_experts, kernel=kernels[0] if kernels else None)
        combine_fixed(send_x, step["send_pos"], out, capacity, kernel=kernels[1] if kernels else None)
    else:
        pack_fixed_torch(step["x"], step["send_pos"], step["ids"], step["weights"], send_x, send_meta, capacity,
                         local_experts)
        combine_fixed_torch(send_x, step["send_pos"], out, capacity)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------------------------

def run_trace(p: Params, device: torch.device, *, use_triton: bool = True) -> dict[str, Any]:
    """Replay the point's trace; returns the info dict (see the module docstring) plus private `_last` state
    (the last step's inputs, buffers, output and kernels) for the timed replay and the check."""
    sizes = trace_batch_sizes(p)
    cap = p.knobs(CapacityKnobs)
    policy, buffer_rows = cap.capacity_policy, cap.num_max_tokens_per_rank
    local_experts = EPLayout.of(p).local_experts
    kernels = (fresh_kernel(PACK_FIXED_KERNEL), fresh_kernel(COMBINE_FIXED_KERNEL)) if use_triton else None
    bufs = _Buffers(p, device)
    steps: list[dict[str, Any]] = []
    capacities: list[int] = []
    last: dict[str, Any] = {}
    mismatched_steps: list[str] = []
    t0 = time.perf_counter()
    with JitCounter() as counter:
        counting = counter.counting and use_triton
        for i, batch in enumerate(sizes):
            step = step_inputs(p, i, batch, device)
            capacity = capacity_for(policy, step["max_rows"], buffer_rows)
            out = torch.empty(step["x"].shape[0], p.hidden, dtype=torch.bfloat16, device=device)
            first_event = len(counter.events)
            _launch(step, bufs, out, capacity, local_experts, kernels, use_triton)
            _sync(device)
            events = [e for e in counter.events[first_event:] if e.completed]
            rec: dict[str, Any] = {"step": i, "batch": int(batch), "max_rows": step["max_rows"],
                                   "capacity": capacity}
            if counting:
                pack = sum(1 for e in events if e.kernel.endswith(PACK_KERNEL))
                combine = sum(1 for e in events if e.kernel.endswith(COMBINE_KERNEL))
                rec.update(compiles=pack, compile_s=round(sum(e.compile_s or 0.0 for e in events), 6),
                           disk_cache_hits=sum(1 for e in events if e.disk_cache_hit is True))
                if combine != pack or len(events) != pack + combine:
                    mismatched_steps.append(f"step {i}: pack {pack}, combine {combine}, other "
                                            f"{len(events) - pack - combine} compiles")
            else:
                rec.update(compiles=None, compile_s=None, disk_cache_hits=None)
            steps.append(rec)
            capacities.append(capacity)
            last = {"step": step, "out": out, "capacity": capacity}
    wall_s = time.perf_counter() - t0

    cumulative = predicted_cumulative(capacities)
    distinct = sorted(set(capacities))
    info: dict[str, Any] = {
        "policy": policy,
        "trace_source": trace_source(p),
        "trace_steps": steps,
        "distinct_capacities": distinct,
        "predicted_compiles": len(distinct),
        "predicted_cumulative": cumulative,
        "pow2_bound": pow2_bound(buffer_rows),
        "buffer_rows": buffer_rows,
        "kernels": [PACK_KERNEL, COMBINE_KERNEL],
        "counting": counting,
        "cache_dir": triton_cache_dir(),
        "trace_wall_s": round(wall_s, 3),
    }
    if counting:
        observed = [s["compiles"] for s in steps]
        info.update(observed_compiles=sum(observed),
                    kernel_compiles=sum(1 for e in counter.events if e.completed),
                    compile_s=round(sum(s["compile_s"] for s in steps), 6),
                    disk_cache_hits=sum(s["disk_cache_hits"] for s in steps))
        if mismatched_steps:
            info["compile_mismatches"] = mismatched_steps[:10]
    else:
        info.update(observed_compiles="unsupported",
                    counting_note=("compile counting unsupported: "
                                   + (unsupported_reason() or "torch reference kernels (no Triton)")))
    info["_last"] = {**last, "buffers": bufs, "kernels": kernels, "local_experts": local_experts}
    return info


def check_trace(info: dict[str, Any], p: Params) -> CheckResult:
    """Capacities follow the policy, the prediction follows the capacities and (where the hooks fire) the observed
    compiles per step equal the predicted new capacities, for both kernels."""
    steps = info["trace_steps"]
    caps = [s["capacity"] for s in steps]
    problems = []
    cap = p.knobs(CapacityKnobs)
    for s in steps:
        why = capacity_problem(cap.capacity_policy, s["max_rows"], s["capacity"], cap.num_max_tokens_per_rank)
        if why:
            problems.append(f"step {s['step']}: {why}")
    expected_pred = {"max": 1}.get(cap.capacity_policy, len(set(caps)))
    if info["predicted_compiles"] != expected_pred or info["predicted_cumulative"] != predicted_cumulative(caps):
        problems.append(f"prediction {info['predicted_compiles']} != {expected_pred} distinct capacities")
    if cap.capacity_policy == "pow2" and info["predicted_compiles"] > info["pow2_bound"]:
        problems.append(f"pow2: {info['predicted_compiles']} capacities > bound {info['pow2_bound']}")
    metrics = {"predicted_compiles": float(info["predicted_compiles"])}
    if info["counting"]:
        new = [b - a for a, b in zip([0] + info["predicted_cumulative"][:-1], info["predicted_cumulative"])]
        bad = [f"step {s['step']}: {s['compiles']} compiles, predicted {n}" for s, n in zip(steps, new)
               if s["compiles"] != n]
        problems += bad[:5] + info.get("compile_mismatches", [])[:5]
        metrics["observed_compiles"] = float(info["observed_compiles"])
        detail = ""
    else:
        detail = info.get("counting_note", "compile counting unsupported") + "; capacities and prediction checked"
    if problems:
        return CheckResult(False, "; ".join(problems[:8]), metrics)
    return CheckResult(True, detail, metrics)


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

def validate_trace(p: Params) -> str | None:
    t, buffer_rows = p.knobs(TraceKnobs), p.knobs(CapacityKnobs).num_max_tokens_per_rank
    top = max(t.trace) if t.trace is not None else t.trace_max_tokens
    if top > buffer_rows:
        key = "trace" if t.trace is not None else "trace_max_tokens"
        return f"{key}: batches up to {top} > num_max_tokens_per_rank {buffer_rows} (the buffer)"
    if p.knobs(ServingKnobs).trace_file is not None:
        return "trace_file: read by the serving_trace target only (jit_trace takes trace: [batch sizes])"
    if p.ep_mode != "real":
        return "ep_mode: jit_trace runs in one process; ep_size only sets the destinations (use ep_mode: real)"
    return None


@register_impl("jit_trace.a2a_fixed", targets=("jit_trace",),
               description="replay a batch-size trace through the a2a_fixed pack/combine kernels under "
                           "capacity_policy; compiles per step (JIT hooks) vs the predicted distinct capacities",
               validate=validate_trace)
def build(p: Params, ctx: RunContext) -> Case:
    use_triton = ctx.is_cuda or interpreting()
    info = run_trace(p, ctx.device, use_triton=use_triton)
    last = info.pop("_last")
    step, out, cap = last["step"], last["out"], last["capacity"]
    bufs, kernels, epr = last["buffers"], last["kernels"], last["local_experts"]
    R = p.ep_size

    def run():
        _launch(step, bufs, out, cap, epr, kernels, use_triton)

    def check() -> CheckResult:
        # the kernels' results on the last step against the torch references (valid slots only: the rest of a
        # block is left as the memory was, by design)
        send_x, send_meta = bufs.views(cap)
        poison(send_x)
        poison(send_meta)
        poison(out)
        run()
        ref_x, ref_meta = torch.empty_like(send_x), torch.empty_like(send_meta)
        pack_fixed_torch(step["x"], step["send_pos"], step["ids"], step["weights"], ref_x, ref_meta, cap, epr)
        ref_out = torch.empty_like(out)
        combine_fixed_torch(ref_x, step["send_pos"], ref_out, cap)
        within = torch.arange(cap, device=out.device).unsqueeze(0) < step["counts"].to(torch.int64).unsqueeze(1)
        rows = within.reshape(R * cap)
        if out.is_cuda or not use_triton:
            out_res = compare_exact("out", out, ref_out)  # fp32 sums in the same order, rounded once: bitwise
        else:
            # the CPU interpreter rounds fp32 -> bf16 by truncation: one ulp apart, exact mismatches reported
            out_res = compare_close("out", out, ref_out, 1e-2, 1e-2)
            out_res.metrics.update(compare_exact("out", out, ref_out).metrics)
        results = [compare_exact("send_x", send_x[rows], ref_x[rows]),
                   compare_exact("send_meta", send_meta[rows], ref_meta[rows]),
                   out_res, check_trace(info, p)]
        res = CheckResult.merge(*results)
        if res.ok:
            res.detail = results[-1].detail
        return res

    x = step["x"]
    T, H = x.shape
    sent = int(step["counts"].sum().item())
    K = p.top_k
    bytes_moved = (2 * T * H + 2 * sent * H) * 2 + T * K * 8 + sent * (2 * K + 1) * 4 + T * R * 4
    return Case(run=run, check=check, bytes_moved=bytes_moved,
                bytes_note="last step: x read + out written, each sent row written by pack and read by combine, "
                           "routing read, metadata written",
                routing=Routing(step["global_ids"], step["is_padding"], p.num_experts, p.ep_size),
                graph_capturable=True, info=info, nvtx_stage="jit_trace")



def _pack_combine_work(p: Params, rows: int | None = None) -> tuple[float, float]:
    """The pack and the combine of one step of `rows` rows (default: the trace's largest batch)."""
    rows = max(trace_batch_sizes(p)) if rows is None else rows
    return 0.0, rows * p.top_k * p.hidden * 2.0 * 4 + rows * p.hidden * 4.0


def _pack_combine_programs(p: Params, rows: int | None = None) -> float:
    """In the interpreter: a fixed part (the plan) and a few programs per (row, destination) pair."""
    rows = max(trace_batch_sizes(p)) if rows is None else rows
    return 30 + 2 * rows * p.top_k


def _distinct_capacities(p: Params) -> int:
    """The capacities the policy will compile (a bound: exact's distinct step maxima are at most the distinct sizes)."""
    policy, buffer_rows = p.knobs(CapacityKnobs).capacity_policy, p.knobs(CapacityKnobs).num_max_tokens_per_rank
    return {"max": 1, "pow2": pow2_bound(buffer_rows)}.get(policy, len(set(trace_batch_sizes(p))))


def _replay_s(p: Params, rates: DeviceRates) -> float:
    """The trace replayed before the timed call: each step's batch built and routed, packed and combined; on a GPU
    each new capacity compiles both kernels."""
    total = 0.0
    for rows in trace_batch_sizes(p):
        if rates.kind == "interpreter":
            total += STEP_INPUTS_S + _pack_combine_programs(p, rows) * INTERP_PROGRAM_S
        else:
            total += STEP_INPUTS_S + rates.seconds(*_pack_combine_work(p, rows), 2)
    return total + (2 * _distinct_capacities(p) * TRITON_COMPILE_S if rates.is_cuda else 0.0)


# the timed call is the last step's pack + combine; building the point replays the whole trace
declare_work("jit_trace", PointWork(call=_pack_combine_work, launches=2, programs=_pack_combine_programs,
                                    build=_replay_s))
