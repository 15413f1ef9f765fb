"""The rank timer runs the rank's expert kernel on exactly its workload: the output of the sliced buffers is the
reference's on the same rows, ids and weights (bf16 and fp8), also after the buffers grew for a larger workload."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.rank_timing import RankTimer
from moebench.kernels.fused_experts import fused_experts_torch
from moebench.kernels.fused_experts_fp8_ref import fused_experts_fp8_torch
from moebench.params import Params, Timing

WALL = Timing(mode="wall", warmup=0, iters=1, unroll=1)


def _params(dtype: str) -> Params:
    # fp8: the weights' 128 x 128 scale blocks need H and I multiples of 128
    hidden, intermediate, group = (128, 128, 128) if dtype == "fp8" else (64, 32, 16)
    return replace(Params(), num_experts=8, ep_size=2, top_k=2, hidden=hidden, intermediate=intermediate,
                   group_size=group, scale_format="fp32", expert_dtype=dtype, seed=5)


def _rel_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (got.float() - ref.float())
    scale = ref.float().abs().max().clamp_min(1e-6)
    return float(d.abs().max() / scale), float(d.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_rank_call_computes_the_reference_on_its_workload(dtype):
    p = _params(dtype)
    timer = RankTimer(p, torch.device("cpu"), WALL)
    small, large = Workload(5, (3, 0, 4, 1)), Workload(19, (7, 19, 0, 2))
    for w in (small, large, small):  # the second small one reads buffers grown for the large one
        call = timer.runner(w)
        t = call.tensors
        t["out"].fill_(float("nan"))  # poisoned: an unwritten row shows
        call()
        assert torch.equal(torch.bincount(t["ids"][t["ids"] >= 0].long(), minlength=4).cpu(),
                           torch.tensor(w.counts))
        if dtype == "fp8":
            w13_q, w13_s, w2_q, w2_s = timer.weights
            ref = fused_experts_fp8_torch(t["x_q"], t["x_sf"], t["ids"].long(), t["topk_w"], w13_q, w13_s, w2_q,
                                          w2_s, group_size=p.group_size, scale_format=p.scale_format)
        else:
            w13, w2 = timer.weights
            ref = fused_experts_torch(t["x"], w13, w2, t["topk_w"], t["ids"].long())
        assert t["out"].shape[0] == w.rows and not t["out"].isnan().any()
        max_rel, rms_rel = _rel_errors(t["out"], ref)
        assert max_rel < 3e-2 and rms_rel < 1e-2, (max_rel, rms_rel)
    assert timer.capacity == 32


def test_a_rank_timing_is_counted_and_an_empty_rank_costs_nothing():
    timer = RankTimer(_params("bf16"), torch.device("cpu"), WALL)
    assert timer(Workload(0, (0, 0, 0, 0))) == 0.0 and timer.timed == 0
    assert timer(Workload(3, (3, 1, 0, 0))) > 0 and timer.timed == 1 and timer.spent_s > 0
    assert timer.last["mode"] == "wall" and timer.last["samples"] == 1
