"""Timing one EP rank's expert work on this device: the layer's expert kernel on exactly the rank's workload.

A rank's workload after dispatch is `Workload(rows, counts)` (moebench.bench._rank_cost): the rows it received and
the routes to each of its local experts. `RankTimer` times fused_experts (bf16 rows) or fused_experts_fp8 (e4m3
rows staged as the layer stages them) on `workload_ids(w)`: local ids with exactly those counts. A grouped GEMM's
time depends on the rows, the per-expert counts (the row tiles and whose weights are read) and top_k, not on the
values, so synthetic rows time the rank as its real rows would.

What a timing costs, and why it is cheap:
- the weights of one rank (p.local_experts experts) are built once; the activations, routing weights and output
  once at the largest rows asked so far (grown by powers of two) and sliced down per workload;
- one untimed call per workload compiles a new specialisation outside the timed region and warms the launch;
  there is no further warm-up (the kernels are compiled and the weights resident);
- a call of at least EAGER_ABOVE_US is GPU-bound (its launches queue ahead of the GPU), so it is timed eagerly
  with CUDA events between back-to-back calls; a shorter one is captured in a CUDA graph (of enough calls to
  last REPLAY_US: the replay's launch hidden) and its replays are timed, the graphs sharing one memory pool;
- samples come in rounds of SAMPLE_ROUND and stop once half their p10-p90 spread is within TIGHT_SPREAD of the
  median (at most timing.iters samples).
`last` keeps the mode, sample count and spread of the latest timing; `spent_s` the host seconds all timings took.
On a CPU (Triton's interpreter) a workload is timed by measure.timing.measure with the sweep's timing (wall clock).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from moebench.bench._rank_cost import Workload, workload_ids
from moebench.params import Params, Timing

EAGER_ABOVE_US = 400.0  # above this a call's launches (~10 kernels, ~150 us of host time) hide behind the GPU
REPLAY_US = 200.0  # a graph replay lasts at least this long (calls per graph: ceil(REPLAY_US / call))
MAX_GRAPH_CALLS = 16
SAMPLE_ROUND = 5
TIGHT_SPREAD = 0.005  # half the p10-p90 spread over the median at which sampling stops


def _spread(samples: list[float]) -> float:
    s = sorted(samples)
    n = len(s) - 1
    p10, p90, p50 = s[math.floor(n * 0.1)], s[math.ceil(n * 0.9)], s[n // 2]
    return (p90 - p10) / 2 / p50 if p50 > 0 else 0.0


class RankTimer:
    """p50 microseconds of the rank's expert kernel on a workload (see the module docstring for how)."""

    def __init__(self, p: Params, device: torch.device, timing: Timing):
        from moebench.bench.experts_fp8 import quantized_expert_weights
        from moebench.inputs import cached_expert_weights

        self.p, self.device, self.timing = p, device, timing
        E, H, I = p.local_experts, p.hidden, p.intermediate
        if p.expert_dtype == "fp8":
            self.weights = quantized_expert_weights(E, H, I, seed=p.seed, device=device)
        else:
            self.weights = cached_expert_weights(E, H, I, p.seed, device)
        self.capacity = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.timed = 0
        self.spent_s = 0.0
        self.last: dict[str, Any] = {}

    def _grow(self, rows: int) -> None:
        """Inputs for at least `rows` rows (seeded: the same values whatever the order of the workloads)."""
        if rows <= self.capacity:
            return
        from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs_torch

        p, dev, cap = self.p, self.device, 1 << max(0, rows - 1).bit_length()
        g = torch.Generator(device="cpu").manual_seed(p.seed * 7_919 + 1)
        x = torch.randn(cap, p.hidden, generator=g).to(device=dev, dtype=torch.bfloat16)
        b = {"x": x, "topk_w": torch.rand(cap, p.top_k, generator=g).to(dev),
             "out": torch.empty(cap, p.hidden, dtype=torch.bfloat16, device=dev)}
        if p.expert_dtype == "fp8":
            ids = torch.zeros(cap, p.top_k, dtype=torch.int64, device=dev)
            b["x_q"], b["x_sf"], _, _ = prepare_moe_inputs_torch(x, b["topk_w"], ids, None, p.group_size,
                                                                 p.scale_format)
        self.buffers, self.capacity = b, cap

    def runner(self, w: Workload) -> Callable[[], Any]:
        """One call of the rank's expert kernel on `w` (its workspace made here, outside any timed region)."""
        from moebench.kernels.fused_experts import fused_experts, make_workspace
        from moebench.kernels.fused_experts_fp8 import fused_experts_fp8, make_fp8_workspace

        p, dev, n = self.p, self.device, w.rows
        K, E, H, I = p.top_k, p.local_experts, p.hidden, p.intermediate
        self._grow(n)
        b = self.buffers
        ids = workload_ids(w, K, dev)
        topk_w, out = b["topk_w"][:n], b["out"][:n]
        if p.expert_dtype == "fp8":
            ws = make_fp8_workspace(n, K, E, H, I, device=dev, group_size=p.group_size, scale_format=p.scale_format)
            x_q, x_sf = b["x_q"][:n], b["x_sf"][:n]
            w13_q, w13_s, w2_q, w2_s = self.weights
            return lambda: fused_experts_fp8(x_q, x_sf, ids, topk_w, w13_q, w13_s, w2_q, w2_s,
                                             group_size=p.group_size, scale_format=p.scale_format, workspace=ws,
                                             out=out)
        w13, w2 = self.weights
        ws = make_workspace(n, K, E, H, I, dtype=torch.bfloat16, device=dev)
        x = b["x"][:n]
        return lambda: fused_experts(x, w13, w2, topk_w, ids, workspace=ws, out=out)

    def __call__(self, w: Workload) -> float:
        if w.rows == 0:
            return 0.0
        t0 = time.perf_counter()
        try:
            fn = self.runner(w)
            us = self._time_cuda(fn) if self.device.type == "cuda" else self._time_host(fn)
        finally:
            self.spent_s += time.perf_counter() - t0
        self.timed += 1
        return us

    def _time_host(self, fn: Callable[[], Any]) -> float:
        from moebench.measure.timing import measure

        stats = measure(fn, self.timing, self.device, graph_capturable=False).stats
        self.last = {"mode": "wall", "samples": int(stats["n"]), "spread": None}
        return float(stats["p50"])

    def _time_cuda(self, fn: Callable[[], Any]) -> float:
        dev = self.device
        fn()  # compiles a new specialisation, if any, and warms the launch: untimed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(dev)
        call_us = start.elapsed_time(end) * 1e3
        graph, calls = None, 1
        if call_us < EAGER_ABOVE_US:
            calls = max(1, min(MAX_GRAPH_CALLS, math.ceil(REPLAY_US / max(call_us, 1.0))))
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                for _ in range(calls):
                    fn()
            graph.replay()
            torch.cuda.synchronize(dev)
        step = graph.replay if graph is not None else fn
        samples: list[float] = []
        most = max(SAMPLE_ROUND, self.timing.iters)
        while len(samples) < most:
            n = min(SAMPLE_ROUND, most - len(samples))
            events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
            events[0].record()
            for i in range(n):  # back to back: each call's end is the next one's start
                step()
                events[i + 1].record()
            torch.cuda.synchronize(dev)
            samples += [events[i].elapsed_time(events[i + 1]) * 1e3 / calls for i in range(n)]
            if _spread(samples) <= TIGHT_SPREAD:
                break
        del graph
        self.last = {"mode": "cuda_graph" if calls > 1 or call_us < EAGER_ABOVE_US else "events",
                     "samples": len(samples), "spread": round(_spread(samples), 5)}
        return sorted(samples)[len(samples) // 2]
