"""The cost of a run before it starts: an estimate of each point's time on the chosen device, printed by
`moebench run` (and `--dry-run`) above the table, with a warning past WARN_AFTER_S.

Each point's work per call comes from its parameters (FLOPs and bytes of the stages its impl runs: the expert
GEMMs' 2*routes*3*H*I FLOPs and the weights of the experts hit, the router's logits, the sum's slots, ...), and
its time from the device:
- a GPU: the roofline time of that work on the device's roofs (moebench.measure.roofline), at least a launch
  latency per kernel, plus a fixed cost per point (build, check, graph capture: GPU_POINT_OVERHEAD_S);
- a CPU: Triton kernels in the interpreter at INTERP_* rates, torch code at CPU_* rates (constants measured on
  the project's CPU machines, the order of magnitude that matters for "minutes or hours"), plus
  CPU_POINT_OVERHEAD_S.
A point costs its check (CHECK_CALLS calls), its warm-up and its timed iterations (cut at timing.max_seconds, as
the wall-clock timer cuts them), its stages timed alone (the layer's), capped at its point timeout. It is an
estimate of the order of magnitude: the progress line replaces it with the measured rate once a point ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench import registry
from moebench.measure.roofline import roofline_us, roofs_for
from moebench.params import Params, Point, Timing
from moebench.traces.knobs import TraceKnobs

WARN_AFTER_S = 30 * 60.0
GPU_LAUNCH_S = 5e-6  # one kernel launch, eager
GPU_POINT_OVERHEAD_S = 1.0  # build, reference check, CUDA-graph capture of one point
CPU_POINT_OVERHEAD_S = 0.3
INTERP_LAUNCH_S = 0.05  # one Triton kernel launch in the interpreter (Python per program instance)
INTERP_FLOPS = 2e9  # tl.dot in the interpreter (numpy)
INTERP_BYTES_PER_S = 2e8  # loads and stores in the interpreter
CPU_CALL_S = 1e-4  # one eager torch call on the CPU
CPU_FLOPS = 2e10
CPU_BYTES_PER_S = 2e9
CHECK_CALLS = 3  # the check's run on poisoned outputs plus its reference
_KERNELS_PER_CALL = {"topk_softmax": 1, "grouped_topk": 1, "prepare_moe_inputs": 1, "apply_expert_map": 1,
                     "globalize_recv_topk_idx": 1, "masked_moe_sum": 1, "moe_align_block_size": 3,
                     "fused_experts": 12, "recv_experts": 12, "layer": 30, "ep_sim": 12, "dispatch": 8,
                     "jit_trace": 4, "serving_trace": 30}  # launch-equivalents: GEMM grids cost several
_LAYER_STAGES = 6  # the layer times each stage alone too


@dataclass(frozen=True)
class RunEstimate:
    total_s: float
    points: int
    capped: int  # points whose estimate reaches their point timeout
    timeout_s: float
    device: str


def _expert_work(p: Params, rows: int, local: int) -> tuple[float, float]:
    """FLOPs and bytes of the grouped expert GEMMs over `rows` rows with `local` local experts."""
    routes = rows * p.top_k * local / p.num_experts
    wbytes = 1 if p.expert_dtype == "fp8" else 2
    flops = 2.0 * routes * 3 * p.hidden * p.intermediate
    nbytes = min(local, routes) * 3 * p.hidden * p.intermediate * wbytes + routes * (2 * p.intermediate + p.hidden) * 2
    return flops, nbytes + rows * p.hidden * 4


def call_work(kernel: str, p: Params) -> tuple[float, float, int]:
    """(FLOPs, bytes, kernel launches) of one call of an impl of `kernel` at point p."""
    T, K, E, H = p.num_tokens, p.top_k, p.num_experts, p.hidden
    launches = _KERNELS_PER_CALL.get(kernel, 1)
    router = (10.0 * T * E, T * E * 4.0 + T * K * 8.0)
    if kernel in ("topk_softmax", "grouped_topk"):
        return (*router, launches)
    if kernel == "prepare_moe_inputs":
        return (0.0, T * H * 3.0 + T * K * 12.0, launches)
    if kernel in ("apply_expert_map", "globalize_recv_topk_idx", "moe_align_block_size"):
        return (0.0, T * K * 16.0, launches)
    if kernel == "masked_moe_sum":
        return (T * K * H * 1.0, T * K * H * 2.0 + T * H * 2.0, launches)
    if kernel in ("fused_experts", "recv_experts", "ep_sim"):
        flops, nbytes = _expert_work(p, T, p.local_experts if kernel != "ep_sim" else E // p.ep_size)
        return (flops, nbytes, launches)
    if kernel == "layer":
        flops, nbytes = _expert_work(p, T, p.local_experts)
        return (flops + router[0], nbytes + router[1] + T * H * 3.0 + T * K * (H * 2.0 + 32), launches)
    if kernel in ("dispatch", "jit_trace"):
        trace = p.knobs(TraceKnobs).trace
        steps = len(trace) if trace else 1
        return (0.0, steps * T * K * H * 4.0, launches * steps)
    if kernel == "serving_trace":  # masked and oblivious at each distinct shape of the trace (a coarse count)
        t = p.knobs(TraceKnobs)
        shapes = 2 * min(t.trace_steps if t.trace is None else len(t.trace), 32)
        rows = min(t.trace_max_tokens, 4096) // 2
        flops, nbytes = _expert_work(p, rows, p.local_experts)
        return (shapes * flops, shapes * nbytes, shapes * launches)
    return (*router, launches)


def _interpreted(impl: registry.Impl) -> bool:
    """Whether the impl's kernels are Triton ones (run in the interpreter on a CPU), not torch code."""
    return impl.library is None and not impl.baseline


def call_s(point: Point, device: torch.device) -> float:
    """Estimated seconds of one call of the point's impl on `device`."""
    impl = registry.get(point.impl)
    flops, nbytes, launches = call_work(impl.kernel, point.params)
    if device.type == "cuda":
        roofs = roofs_for(torch.cuda.get_device_name(device) if torch.cuda.is_available() else None)
        return max(roofline_us(int(flops), int(nbytes), roofs) * 1e-6, launches * GPU_LAUNCH_S)
    from moebench.kernels.runtime import interpreting

    if interpreting() and _interpreted(impl):
        return launches * INTERP_LAUNCH_S + flops / INTERP_FLOPS + nbytes / INTERP_BYTES_PER_S
    return launches * CPU_CALL_S + flops / CPU_FLOPS + nbytes / CPU_BYTES_PER_S


def point_s(point: Point, timing: Timing, device: torch.device) -> float:
    """Estimated seconds of the whole point (uncapped): overhead, check, warm-up, timed iterations, stages."""
    c = call_s(point, device)
    cpu = device.type != "cuda"

    def timed(per_call: float) -> float:
        iters = timing.iters * per_call
        if cpu:  # the wall-clock timer stops after max_seconds (at least one iteration)
            iters = min(iters, max(timing.max_seconds, per_call))
        return timing.warmup * per_call + iters

    stages = _LAYER_STAGES * timed(c / _LAYER_STAGES) if registry.get(point.impl).kernel == "layer" else 0.0
    overhead = CPU_POINT_OVERHEAD_S if cpu else GPU_POINT_OVERHEAD_S
    return overhead + CHECK_CALLS * c + timed(c) + stages


def estimate_run(points: list[Point], timing: Timing, device: torch.device) -> RunEstimate:
    from moebench.run.point_worker import point_timeout_s

    timeout = point_timeout_s(timing, device)
    each = [point_s(pt, timing, device) for pt in points]
    return RunEstimate(total_s=sum(min(s, timeout) for s in each), points=len(points),
                       capped=sum(s >= timeout for s in each), timeout_s=timeout, device=str(device))


def estimate_lines(est: RunEstimate, sizes: dict | None = None) -> tuple[list[str], str | None]:
    """The `#` lines stating the estimate, and a warning (None under WARN_AFTER_S)."""
    from moebench.run.progress import duration

    text = f"estimate: ~{duration(est.total_s)} for {est.points} points on {est.device} (from each point's work"
    text += " and the device's roofs)" if est.device.startswith("cuda") else " and the CPU's rates)"
    lines = [text]
    if est.capped:
        lines.append(f"estimate: {est.capped} points would reach the point timeout of {duration(est.timeout_s)} "
                     "(recorded failed)")
    warning = None
    if est.total_s > WARN_AFTER_S:
        hint = ""
        if not est.device.startswith("cuda") and sizes and "cpu" in sizes:
            hint = "; `--size cpu` runs this sweep at the shapes it declares for a CPU"
        warning = f"this run is estimated at ~{duration(est.total_s)} on {est.device}, over 30 minutes{hint}"
    return lines, warning
