"""Timing one EP rank's expert work on this device: the layer's expert kernel on exactly the rank's workload.

A rank's workload after dispatch is `Workload(rows, counts)` (moebench.bench.serving_trace.rank_cost): the rows it
received and the routes to each of its local experts. `RankTimer` times fused_experts (bf16 rows) or
fused_experts_fp8 (e4m3 rows staged as the layer stages them) on `workload_ids(w)`: local ids with exactly those
counts. A grouped GEMM's time depends on the rows, the per-expert counts (the row tiles and whose weights are read)
and top_k, not on the values, so synthetic rows time the rank as its real rows would.

What a timing costs, and why it is cheap:
- the weights of one rank (p.local_experts experts) are built once; the activations, routing weights and output
  once at the largest rows asked so far (grown by powers of two) and sliced down per workload;
- each workload is timed by measure.timing.measure_settled: one untimed call (a new specialisation compiled
  outside the timed region; no further warm-up), eager calls back to back where the call is GPU-bound, else a
  CUDA graph (all of the point's graphs in one memory pool), samples until their spread has settled (at most
  timing.iters).
`last` keeps the mode, sample count and spread of the latest timing; `spent_s` the host seconds all timings took.
On a CPU (Triton's interpreter) a workload is timed by measure.timing.measure with the sweep's timing (wall clock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moebench.bench.serving_trace.rank_cost import Workload, workload_ids
from moebench.params import Params, Timing


class RankStore:
    """One run's rank-workload timings at one layer point, {Workload: us}, kept while the run's points share their
    layer parameters (shapes.layer_key): the points of a what-if axis over capture lists read each workload another
    timed (the masked side's workloads are the same under every list), so a workload has one time in the run. The
    store is the run's (RunContext.run_store): nothing outlives the run."""

    RUN_STORE_KEY = "serving_trace.rank_workloads"

    def __init__(self):
        self.layer_key: tuple | None = None
        self.timed: dict[Workload, float] = {}

    @classmethod
    def of_run(cls, run_store: dict) -> "RankStore":
        return run_store.setdefault(cls.RUN_STORE_KEY, cls())

    def for_layer(self, layer_key: tuple) -> dict[Workload, float]:
        """The timings at the layer point `layer_key`; another layer point's are dropped first."""
        if self.layer_key != layer_key:
            self.timed, self.layer_key = {}, layer_key
        return self.timed


@dataclass(frozen=True)
class RankCall:
    """One call of a rank's expert kernel, and the tensors it reads and writes (views of the timer's buffers)."""

    call: Callable[[], Any]
    tensors: dict[str, torch.Tensor]

    def __call__(self) -> Any:
        return self.call()


class RankTimer:
    """p50 microseconds of the rank's expert kernel on a workload (see the module docstring for how). The one way
    a rank is timed on one device: the serving trace's EP step and ep_sim's simulated ranks. `triton=False` times
    the bf16 reference in torch instead (a CPU without the interpreter: ep_sim's torch path)."""

    def __init__(self, p: Params, device: torch.device, timing: Timing, *, triton: bool = True):
        from moebench.bench.experts_fp8 import quantized_expert_weights
        from moebench.inputs import cached_expert_weights

        if not triton and p.expert_dtype == "fp8":
            raise ValueError("RankTimer: the torch reference times bf16 experts only")
        self.p, self.device, self.timing, self.triton = p, device, timing, triton
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

    def runner(self, w: Workload) -> "RankCall":
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
            return RankCall(lambda: fused_experts_fp8(x_q, x_sf, ids, topk_w, w13_q, w13_s, w2_q, w2_s,
                                                      group_size=p.group_size, scale_format=p.scale_format,
                                                      workspace=ws, out=out),
                            {"x_q": x_q, "x_sf": x_sf, "ids": ids, "topk_w": topk_w, "out": out})
        w13, w2 = self.weights
        x = b["x"][:n]
        if not self.triton:
            from moebench.kernels.fused_experts import fused_experts_torch

            return RankCall(lambda: out.copy_(fused_experts_torch(x, w13, w2, topk_w, ids,
                                                                  compute_dtype=torch.bfloat16)),
                            {"x": x, "ids": ids, "topk_w": topk_w, "out": out})
        ws = make_workspace(n, K, E, H, I, dtype=torch.bfloat16, device=dev)
        return RankCall(lambda: fused_experts(x, w13, w2, topk_w, ids, workspace=ws, out=out),
                        {"x": x, "ids": ids, "topk_w": topk_w, "out": out})

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
        from moebench.measure.timing import measure_settled

        got = measure_settled(fn, self.device, self.timing.iters, pool=self.pool)
        self.last = {"mode": got.mode, "samples": got.samples, "spread": round(got.spread, 5)}
        return got.us
