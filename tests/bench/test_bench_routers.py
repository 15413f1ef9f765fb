"""bench/routers.py: compare_routing (exact ids, near-ties only where the reference shows one, padded rows, weights)
and the registered router cases."""

from __future__ import annotations

import math

import pytest
import torch

from moebench.kernels.runtime import tuning
from moebench.bench.routers import compare_routing, grouped_topk_reference, topk_softmax_reference


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _next_up(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(math.inf)).item()


def test_compare_routing_expert_level():
    logits = torch.tensor([[1.0, _next_up(1.0), -1.0, 0.5], [0.3, 0.2, 0.1, 0.0]])
    ref = topk_softmax_reference(logits, 2, False)
    assert ref.ids.tolist() == [[1, 0], [0, 1]]
    assert compare_routing(ref.weights.clone(), ref.ids.clone(), ref).ok
    # experts 0 and 1 are 1 ulp apart: the swap is a near-tie, counted and accepted (weights of the swapped ids)
    swapped = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    w = torch.softmax(logits, -1).gather(1, swapped.long())
    res = compare_routing(w, swapped, ref)
    assert res.ok and res.metrics["ids.near_tie_rows"] == 1 and res.metrics["ids.mismatches"] == 2
    # a swap of clearly different scores is wrong
    wrong = torch.tensor([[1, 0], [1, 0]], dtype=torch.int32)
    res = compare_routing(torch.softmax(logits, -1).gather(1, wrong.long()), wrong, ref)
    assert not res.ok and res.metrics["ids.bad_rows"] == 1
    # so is a duplicated id, an out-of-range id, and a weight off by 1e-4
    for bad in ([[1, 1], [0, 1]], [[1, 4], [0, 1]]):
        assert not compare_routing(ref.weights, torch.tensor(bad, dtype=torch.int32), ref).ok
    w = ref.weights.clone()
    w[1, 0] *= 1 + 1e-4
    res = compare_routing(w, ref.ids, ref)
    assert not res.ok and "weights" in res.detail


def test_compare_routing_padded_rows_and_shapes():
    logits = torch.randn(4, 8, generator=_gen(3))
    mask = torch.tensor([False, True, False, True])
    ref = topk_softmax_reference(logits, 2, True, is_padding=mask)
    w, ids = ref.weights.clone(), ref.ids.clone()
    assert compare_routing(w, ids, ref).ok
    w2 = w.clone()
    w2[1, 0] = -0.0  # padded weights must be +0.0 bit for bit
    assert not compare_routing(w2, ids, ref).ok
    ids2 = ids.clone()
    ids2[3, 1] = 0
    assert not compare_routing(w, ids2, ref).ok
    assert not compare_routing(w[:, :1], ids[:, :1], ref).ok
    assert not compare_routing(w, ids.long(), ref).ok


def test_compare_routing_group_level_near_tie():
    # 4 groups of 2, keep 1 group, top-1, no bias: group scores are the group maxima; the maxima of groups 0 and 1
    # are 1 ulp apart after the sigmoid
    x = 1.0
    while torch.sigmoid(torch.tensor(x)) == torch.sigmoid(torch.tensor(1.0)):
        x = _next_up(x)
    logits = torch.tensor([[1.0, 0.2, x, 0.1, -1.0, -2.0, 0.0, -0.5]])
    ref = grouped_topk_reference(logits, 1, 4, 1, scoring="sigmoid", renormalize=False)
    assert ref.ids.tolist() == [[2]]
    s = torch.sigmoid(logits)
    other_group = torch.tensor([[0]], dtype=torch.int32)
    res = compare_routing(s.gather(1, other_group.long()), other_group, ref)
    assert res.ok and res.metrics["ids.near_tie_rows"] == 1
    not_best_in_group = torch.tensor([[1]], dtype=torch.int32)
    assert not compare_routing(s.gather(1, not_best_in_group.long()), not_best_in_group, ref).ok
    far_group = torch.tensor([[6]], dtype=torch.int32)
    assert not compare_routing(s.gather(1, far_group.long()), far_group, ref).ok


@pytest.mark.parametrize("impl", ["topk_softmax.triton", "topk_softmax.torch", "grouped_topk.triton",
                                  "grouped_topk.torch"])
@pytest.mark.parametrize("mask", [True, False])
def test_registered_router_cases(device, impl, mask):
    from moebench import registry
    from moebench.registry import RunContext
    from moebench.params import Params

    grouped = impl.startswith("grouped")
    p = Params(num_tokens=48, num_experts=64, top_k=6, padding_ratio=0.25, mask=mask, padding_fill="repeat",
               bias=True, dtype="bf16", routing="zipf",
               **(dict(num_expert_group=8, topk_group=4, scoring="sigmoid", routed_scaling_factor=2.5)
                  if grouped else {}))
    entry = registry.get(impl)
    assert set(entry.targets) == {"router", "kernel"}
    assert entry.validate(p) is None
    case = entry.build(p, RunContext(device=device))
    res = case.check()
    assert res.ok, res.detail
    assert res.metrics["ids.mismatches"] == 0 and res.metrics["ids.bad_rows"] == 0
    assert case.nvtx_stage == "route"
    num_padding = p.num_padding
    assert case.bytes_moved == 48 * 64 * 2 + 48 * 6 * 8 + (48 if mask else 0) + 64 * 4
    case.run()
    ids = case.routing.topk_ids
    assert ids.shape == (48, 6) and case.routing.num_experts == 64
    assert case.routing.is_padding.sum().item() == num_padding
    if mask:
        assert (ids[case.routing.is_padding] == -1).all()
    else:  # unmasked: padded rows (copies of row 0 here) are routed like the real row they copy
        assert (ids >= 0).all()
        assert (ids[case.routing.is_padding] == ids[0]).all()


def test_router_validate_reasons():
    from moebench import registry
    from moebench.params import Params

    for name in ("topk_softmax.triton", "topk_softmax.torch"):
        impl = registry.get(name)
        assert "top_k" in impl.validate(Params(num_experts=64, top_k=33))
        assert "num_experts" in impl.validate(Params(num_experts=2048, top_k=8))
        assert impl.validate(Params(num_experts=384, top_k=32)) is None
    impl = registry.get("grouped_topk.triton")
    assert impl.validate(Params(num_experts=256, top_k=8, num_expert_group=8, topk_group=4)) is None
    assert "experts per group" in impl.validate(Params(num_experts=8, top_k=2, num_expert_group=8, topk_group=4,
                                                       bias=True))


def test_compare_routing_non_finite_rows():
    # the reference clamps NaN scores to 0 (docs/contracts.md "Routers"): a poisoned row routes to 0..K-1 with
    # weights 0; the pre-clamp output (same ids, NaN weights) and duplicated ids are rejected
    logits = torch.randn(3, 8, generator=_gen(5))
    logits[1] = float("nan")
    logits[2] = float("inf")
    for renormalize in (False, True):
        ref = topk_softmax_reference(logits, 3, renormalize)
        assert ref.ids[1:].tolist() == [[0, 1, 2]] * 2 and (ref.weights[1:] == 0).all()
        assert compare_routing(ref.weights.clone(), ref.ids.clone(), ref).ok
        nan_weights = ref.weights.clone()
        nan_weights[1:] = float("nan")
        res = compare_routing(nan_weights, ref.ids.clone(), ref)
        assert not res.ok and "weights" in res.detail
        dup = ref.ids.clone()
        dup[1] = 0
        assert not compare_routing(ref.weights.clone(), dup, ref).ok
    ref = grouped_topk_reference(logits, 3, 2, 1, scoring="sigmoid", bias=torch.zeros(8))
    assert ref.ids[1].tolist() == [0, 1, 2] and ref.ids[2].tolist() == [0, 1, 2]
    assert torch.isfinite(ref.weights).all() and compare_routing(ref.weights.clone(), ref.ids.clone(), ref).ok


@pytest.mark.parametrize("impl", ["topk_softmax.triton", "grouped_topk.triton"])
def test_router_cases_record_the_router_config(device, impl):
    # the point's `config` picks the launch config, and the record says which and where it came from
    import dataclasses

    from moebench import registry
    from moebench.registry import RunContext
    from moebench.params import Params

    p = Params(num_tokens=20, num_experts=64, top_k=6, padding_ratio=0.25, mask=True, padding_fill="repeat",
               bias=True, dtype="bf16", num_expert_group=8, topk_group=4, scoring="sigmoid")
    ctx = RunContext(device=device)
    info = registry.get(impl).build(p, ctx).info
    assert info["config_source"] == "rule" if device.type == "cpu" else info["config_source"] in ("rule", "table")
    if info["config_source"] == "rule":  # no tuned table entry (never one on the CPU)
        assert info["config"] == tuning.tunable(impl.split(".")[0]).rule()[0]  # the routers' default launch
    case = registry.get(impl).build(dataclasses.replace(p, config="cand2"), ctx)
    assert (case.info["config"], case.info["config_source"]) == ("cand2", "explicit")
    assert case.info["config_bucket"].startswith("T=32,E=64,K=6")
    res = case.check()
    assert res.ok and res.metrics["ids.mismatches"] == 0, res.detail
    assert "config" not in registry.get(impl.replace("triton", "torch")).build(p, ctx).info
    assert registry.get(impl).tuned_kernel == impl.split(".")[0]
