"""Routers (topk_softmax, grouped_topk): Triton kernels against their eager-torch references (SPEC.md "Routers").

CPU runs use Triton's interpreter (tests/conftest.py) at small T; the @gpu test repeats the comparison at serving
sizes. ids are compared exactly, weights by max/RMS relative error (<= 1e-5); outputs are poisoned first.
"""

from __future__ import annotations

import math

import pytest
import torch

from moebench.check import poison
from moebench.bench.routers import RouterReference, compare_routing, grouped_topk_reference, topk_softmax_reference
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch
from moebench.kernels.topk_softmax import topk_softmax, topk_softmax_torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _logits(num_tokens, num_experts, dtype, seed, device, scale=2.0):
    return (torch.randn(num_tokens, num_experts, generator=_gen(seed)) * scale).to(dtype).to(device)


def _bias(num_experts, seed, device):
    return ((torch.rand(num_experts, generator=_gen(seed + 1)) - 0.5) * 0.2).to(device)


def _mask(num_tokens, ratio, seed, device):
    return (torch.rand(num_tokens, generator=_gen(seed + 2)) < ratio).to(device)


def _poisoned_out(num_tokens, top_k, device):
    out = (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
           torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))
    for t in out:
        poison(t)
    return out


def _assert_same_as_reference(weights, ids, ref: RouterReference):
    """ids bit for bit (random CPU inputs have no near-ties), weights within 1e-5, padded rows exactly -1 / +0.0."""
    res = compare_routing(weights, ids, ref)
    assert res.ok, res.detail
    assert torch.equal(ids.cpu(), ref.ids.cpu()), "ids differ from the reference"
    assert res.metrics["ids.near_tie_rows"] == 0
    assert res.metrics["weights.max_rel"] <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# topk_softmax
# ---------------------------------------------------------------------------------------------------------------

SHAPES = [(8, 1), (8, 2), (8, 6), (8, 8), (160, 6), (160, 8), (160, 32), (384, 2), (384, 32), (1024, 1),
          (1024, 8), (1024, 32)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_experts,top_k", SHAPES)
def test_topk_softmax_matches_reference(device, dtype, num_experts, top_k):
    # 37 rows: not a multiple of any row block; bias / renormalize / padding vary with the shape
    case = SHAPES.index((num_experts, top_k))
    num_tokens = 37
    seed = 100 * case + len(dtype)
    logits = _logits(num_tokens, num_experts, DTYPES[dtype], seed, device)
    bias = _bias(num_experts, seed, device) if case % 2 else None
    renormalize = case % 3 != 1
    is_padding = _mask(num_tokens, 0.3, seed, device) if case % 4 < 2 else None
    out = _poisoned_out(num_tokens, top_k, device)
    weights, ids = topk_softmax(logits, top_k, renormalize, is_padding=is_padding, bias=bias, out=out)
    assert weights.data_ptr() == out[0].data_ptr() and ids.data_ptr() == out[1].data_ptr()
    ref = topk_softmax_reference(logits, top_k, renormalize, is_padding=is_padding, bias=bias)
    _assert_same_as_reference(weights, ids, ref)
    # the reference's own contract: descending selection score, unbiased weights, -1 / 0.0 on padded rows
    _, selection = torch.softmax(logits.float(), -1), torch.softmax(logits.float(), -1)
    if bias is not None:
        selection = selection + bias
    live = ~is_padding if is_padding is not None else torch.ones(num_tokens, dtype=torch.bool, device=device)
    chosen = selection[live].gather(1, ref.ids[live].long())
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()
    if is_padding is not None:
        assert (ref.ids[is_padding] == -1).all() and (ref.weights[is_padding] == 0).all()


def test_topk_softmax_renormalize_and_weights(device):
    logits = _logits(24, 64, torch.float32, 7, device)
    bias = _bias(64, 7, device)
    probs = torch.softmax(logits.float(), -1)
    for fn in (topk_softmax, topk_softmax_torch):
        w_raw, ids = fn(logits, 6, False, bias=bias)
        # unbiased p at the chosen ids (the bias only ranks)
        torch.testing.assert_close(w_raw, probs.gather(1, ids.long()), rtol=1e-6, atol=0)
        w_norm, ids2 = fn(logits, 6, True, bias=bias)
        assert torch.equal(ids, ids2)
        torch.testing.assert_close(w_norm.sum(-1), torch.ones(24, device=device), rtol=1e-6, atol=0)
        torch.testing.assert_close(w_norm, w_raw / w_raw.sum(-1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_topk_softmax_ties_go_to_lower_index(device, dtype):
    num_experts, top_k = 40, 6
    logits = _logits(6, num_experts, torch.float32, 3, device, scale=0.5)
    logits[0] = 1.0  # every expert ties: 0..5
    logits[1, [31, 4, 17]] = 5.0  # three-way tie at the top, then the rest by value
    logits[2, [9, 2]] = 4.0
    logits[2, [33, 20, 1]] = 3.0  # two tie groups: 2, 9 then 1, 20, 33
    logits[3, :] = -2.0
    logits[3, [39, 38]] = 0.0  # only two above the rest: then the ties among the rest go to 0, 1, ...
    logits[4, [12, 13, 14, 15, 16, 17]] = 2.0  # the whole top-k is one tie group
    logits = logits.to(DTYPES[dtype])
    expect = {0: [0, 1, 2, 3, 4, 5], 1: [4, 17, 31], 2: [2, 9, 1, 20, 33], 3: [38, 39, 0, 1, 2, 3],
              4: [12, 13, 14, 15, 16, 17]}
    bias_tied = torch.zeros(num_experts, device=device)  # equal bias keeps the ties ties
    for bias in (None, bias_tied):
        for fn in (topk_softmax_torch, topk_softmax):
            _, ids = fn(logits, top_k, True, bias=bias)
            for row, want in expect.items():
                assert ids[row, :len(want)].tolist() == want, (fn.__name__, row, ids[row].tolist())
        w, ids = topk_softmax(logits, top_k, True, bias=bias)
        _assert_same_as_reference(w, ids, topk_softmax_reference(logits, top_k, True, bias=bias))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_topk_softmax_distinct_logits_with_equal_p_tie(device, dtype):
    # tiny logits next to a large max: 1e-7 and 2e-7 differ, but x - 8 rounds to -8.0 for both, so their fp32 p
    # are equal and the tie rule (lower index first) applies, not the logit order
    row = torch.full((16,), -5.0)
    row[0], row[1], row[2], row[5], row[9] = 8.0, 1e-7, 2e-7, 2e-7, -1e-7
    logits = torch.stack([row, row.flip(0)]).to(DTYPES[dtype]).to(device)
    p = torch.softmax(logits.float(), -1)
    assert logits[0, 1] != logits[0, 2] and p[0, 1] == p[0, 2] == p[0, 9]
    for fn in (topk_softmax_torch, topk_softmax):
        _, ids = fn(logits, 5, False)
        assert ids.tolist() == [[0, 1, 2, 5, 9], [15, 6, 10, 13, 14]], fn.__name__


def test_topk_softmax_bias_decides_selection_not_weight(device):
    logits = torch.zeros(3, 8, device=device)
    logits[:, 0] = 1.0  # expert 0 has the largest p in every row
    bias = torch.zeros(8, device=device)
    bias[5] = 1.0  # ... but expert 5 wins the selection
    for fn in (topk_softmax_torch, topk_softmax):
        w, ids = fn(logits, 2, False, bias=bias)
        assert ids[:, 0].tolist() == [5, 5, 5] and ids[:, 1].tolist() == [0, 0, 0]
        p = torch.softmax(logits, -1)
        torch.testing.assert_close(w[:, 0], p[:, 5], rtol=1e-6, atol=0)
        torch.testing.assert_close(w[:, 1], p[:, 0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fill", ["random", "all", "none"])
def test_topk_softmax_padding_rows(device, fill):
    num_tokens, num_experts, top_k = 45, 256, 8
    logits = _logits(num_tokens, num_experts, torch.bfloat16, 11, device)
    is_padding = {"random": _mask(num_tokens, 0.4, 11, device),
                  "all": torch.ones(num_tokens, dtype=torch.bool, device=device),
                  "none": torch.zeros(num_tokens, dtype=torch.bool, device=device)}[fill]
    # NaN in padded rows must not reach anything: their logits are never read
    logits[is_padding] = float("nan")
    for fn in (topk_softmax, topk_softmax_torch):
        w, ids = fn(logits, top_k, True, is_padding=is_padding, out=_poisoned_out(num_tokens, top_k, device))
        assert (ids[is_padding] == -1).all()
        assert (w[is_padding].view(torch.int32) == 0).all()  # +0.0 exactly
        assert (ids[~is_padding] >= 0).all() and torch.isfinite(w).all()
    w, ids = topk_softmax(logits, top_k, True, is_padding=is_padding)
    _assert_same_as_reference(w, ids, topk_softmax_reference(logits, top_k, True, is_padding=is_padding))


def test_topk_softmax_none_mask_equals_no_padding_bitwise(device):
    logits = _logits(33, 160, torch.float16, 5, device)
    bias = _bias(160, 5, device)
    none_padded = torch.zeros(33, dtype=torch.bool, device=device)
    for fn in (topk_softmax, topk_softmax_torch):
        w0, i0 = fn(logits, 6, True, is_padding=None, bias=bias)
        w1, i1 = fn(logits, 6, True, is_padding=none_padded, bias=bias)
        assert torch.equal(i0, i1)
        assert torch.equal(w0.view(torch.int32), w1.view(torch.int32))


def test_router_mask_size_mismatch(device):
    logits = _logits(7, 16, torch.float32, 1, device)
    short = torch.zeros(6, dtype=torch.bool, device=device)
    msg = r"^is_padding size mismatch, expected: 7, got: 6$"
    for fn in (topk_softmax, topk_softmax_torch):
        with pytest.raises(ValueError, match=msg):
            fn(logits, 2, True, is_padding=short)
    for fn in (grouped_topk, grouped_topk_torch):
        with pytest.raises(ValueError, match=msg):
            fn(logits, 2, 4, 2, is_padding=short)


def test_router_argument_errors(device):
    logits = _logits(4, 16, torch.float32, 1, device)
    for fn in (topk_softmax, topk_softmax_torch):
        with pytest.raises(ValueError, match="top_k"):
            fn(logits, 17, True)
        with pytest.raises(ValueError, match="top_k"):
            fn(logits, 0, True)
        with pytest.raises(ValueError, match="bias"):
            fn(logits, 2, True, bias=torch.zeros(15, device=device))
        with pytest.raises(TypeError, match="bool"):
            fn(logits, 2, True, is_padding=torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="top_k <= 32"):
        topk_softmax(_logits(2, 64, torch.float32, 1, device), 33, True)
    with pytest.raises(ValueError, match="num_experts <= 1024"):
        topk_softmax(_logits(2, 1025, torch.float32, 1, device), 2, True)
    for fn in (grouped_topk, grouped_topk_torch):
        with pytest.raises(ValueError, match="does not divide"):
            fn(logits, 2, 3, 1)
        with pytest.raises(ValueError, match="topk_group"):
            fn(logits, 2, 4, 5)
        with pytest.raises(ValueError, match="kept groups"):
            fn(logits, 9, 4, 2)  # 2 groups of 4 experts hold only 8
        with pytest.raises(ValueError, match="scoring"):
            fn(logits, 2, 4, 2, scoring="relu")
        with pytest.raises(ValueError, match=">= 2 experts per group"):
            fn(logits, 2, 16, 2, bias=torch.zeros(16, device=device))


def test_router_zero_tokens(device):
    logits = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    mask = torch.empty(0, dtype=torch.bool, device=device)
    for w, ids in (topk_softmax(logits, 8, True, is_padding=mask), topk_softmax_torch(logits, 8, True),
                   grouped_topk(logits, 8, 8, 4, scoring="sigmoid", bias=torch.zeros(64, device=device)),
                   grouped_topk_torch(logits, 8, 8, 4, is_padding=mask)):
        assert w.shape == (0, 8) and ids.shape == (0, 8) and w.dtype == torch.float32 and ids.dtype == torch.int32


# ---------------------------------------------------------------------------------------------------------------
# grouped_topk
# ---------------------------------------------------------------------------------------------------------------

GROUPED = [  # num_experts, num_expert_group, topk_group, top_k
    (256, 8, 4, 8), (160, 5, 2, 6), (64, 4, 2, 8), (384, 3, 2, 32), (48, 6, 4, 5), (64, 1, 1, 4), (1024, 16, 4, 8),
]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", GROUPED)
def test_grouped_topk_matches_reference(device, scoring, with_bias, shape):
    num_experts, groups, topk_group, top_k = shape
    case = GROUPED.index(shape)
    num_tokens = 29
    dtype = list(DTYPES.values())[case % 3]
    seed = 1000 + 10 * case + with_bias
    logits = _logits(num_tokens, num_experts, dtype, seed, device)
    bias = _bias(num_experts, seed, device) if with_bias else None
    is_padding = _mask(num_tokens, 0.25, seed, device) if case % 2 == 0 else None
    renormalize = case != 3
    scale = 2.5 if case % 3 == 1 else 1.0
    kwargs = dict(scoring=scoring, bias=bias, renormalize=renormalize, routed_scaling_factor=scale,
                  is_padding=is_padding)
    out = _poisoned_out(num_tokens, top_k, device)
    w, ids = grouped_topk(logits, top_k, groups, topk_group, out=out, **kwargs)
    ref = grouped_topk_reference(logits, top_k, groups, topk_group, **kwargs)
    _assert_same_as_reference(w, ids, ref)
    # every chosen expert lies in one of topk_group groups
    live = ~is_padding if is_padding is not None else torch.ones(num_tokens, dtype=torch.bool, device=device)
    used = ids[live].long() // (num_experts // groups)
    assert all(row.unique().numel() <= topk_group for row in used)


def test_grouped_topk_weights_scaling_and_renormalize(device):
    logits = _logits(16, 64, torch.float32, 21, device)
    bias = _bias(64, 21, device)
    s = torch.sigmoid(logits)
    for fn in (grouped_topk, grouped_topk_torch):
        w_raw, ids = fn(logits, 6, 8, 3, scoring="sigmoid", bias=bias, renormalize=False)
        torch.testing.assert_close(w_raw, s.gather(1, ids.long()), rtol=1e-6, atol=0)
        w, ids2 = fn(logits, 6, 8, 3, scoring="sigmoid", bias=bias, renormalize=True, routed_scaling_factor=2.5)
        assert torch.equal(ids, ids2)
        torch.testing.assert_close(w, 2.5 * w_raw / w_raw.sum(-1, keepdim=True), rtol=1e-6, atol=0)
        w_scaled, _ = fn(logits, 6, 8, 3, scoring="sigmoid", bias=bias, renormalize=False,
                         routed_scaling_factor=0.5)
        torch.testing.assert_close(w_scaled, 0.5 * w_raw, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_group_ties(device, scoring, with_bias):
    # 4 groups of 4; groups 1, 2, 3 identical (equal group scores), group 0 lower: keeping 2 groups keeps 1 and 2,
    # and between equal experts of groups 1 and 2 the lower expert index (group 1's) comes first
    row = torch.tensor([0.1, 0.0, -0.2, 0.05, 2.0, 1.0, 3.0, 0.5, 2.0, 1.0, 3.0, 0.5, 2.0, 1.0, 3.0, 0.5])
    logits = torch.stack([row, row.flip(0)]).to(device)  # second row: groups 0, 1, 2 tie, group 3 lower
    bias = torch.zeros(16, device=device) if with_bias else None
    expect = {0: [6, 10, 4, 8], 1: [1, 5, 3, 7]}
    for fn in (grouped_topk_torch, grouped_topk):
        w, ids = fn(logits, 4, 4, 2, scoring=scoring, bias=bias)
        for r, want in expect.items():
            assert ids[r].tolist() == want, (fn.__name__, r, ids[r].tolist())
    w, ids = grouped_topk(logits, 4, 4, 2, scoring=scoring, bias=bias)
    _assert_same_as_reference(w, ids, grouped_topk_reference(logits, 4, 4, 2, scoring=scoring, bias=bias))


def test_grouped_topk_group_score_is_top2_sum_with_bias(device):
    # group 0 has the single best expert, group 1 the better top-2 sum: without a bias the max decides (group 0),
    # with a (zero) bias the top-2 sum decides (group 1); a maximum occurring twice counts twice (group 2)
    logits = torch.tensor([[4.0, -3.0, -3.0, -3.0, 3.0, 3.0, -3.0, -3.0, 3.2, 3.2, -3.0, -3.0]], device=device)
    for fn in (grouped_topk_torch, grouped_topk):
        _, ids = fn(logits, 1, 3, 1, scoring="sigmoid")
        assert ids.tolist() == [[0]]
        _, ids = fn(logits, 1, 3, 1, scoring="sigmoid", bias=torch.zeros(12, device=device))
        assert ids.tolist() == [[8]]


def test_grouped_topk_padding_and_none_mask(device):
    logits = _logits(40, 256, torch.bfloat16, 31, device)
    bias = _bias(256, 31, device)
    mask = _mask(40, 0.5, 31, device)
    logits[mask] = float("nan")
    w, ids = grouped_topk(logits, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=mask,
                          out=_poisoned_out(40, 8, device))
    assert (ids[mask] == -1).all() and (w[mask].view(torch.int32) == 0).all()
    ref = grouped_topk_reference(logits, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=mask)
    _assert_same_as_reference(w, ids, ref)
    clean = logits.clone()
    clean[mask] = 0.0
    none_padded = torch.zeros(40, dtype=torch.bool, device=device)
    for fn in (grouped_topk, grouped_topk_torch):
        w0, i0 = fn(clean, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=None)
        w1, i1 = fn(clean, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=none_padded)
        assert torch.equal(i0, i1) and torch.equal(w0.view(torch.int32), w1.view(torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# compare_routing: exact where it can be, near-ties only where the reference's own scores show one
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# Registration: build / check / bytes / routing for the four impls
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["topk_softmax.triton", "topk_softmax.torch", "grouped_topk.triton",
                                  "grouped_topk.torch"])
@pytest.mark.parametrize("mask", [True, False])
def test_registered_router_cases(device, impl, mask):
    from moebench import registry
    from moebench.registry import RunContext
    from moebench.sweep import Params

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
    from moebench.sweep import Params

    for name in ("topk_softmax.triton", "topk_softmax.torch"):
        impl = registry.get(name)
        assert "top_k" in impl.validate(Params(num_experts=64, top_k=33))
        assert "num_experts" in impl.validate(Params(num_experts=2048, top_k=8))
        assert impl.validate(Params(num_experts=384, top_k=32)) is None
    impl = registry.get("grouped_topk.triton")
    assert impl.validate(Params(num_experts=256, top_k=8, num_expert_group=8, topk_group=4)) is None
    assert "experts per group" in impl.validate(Params(num_experts=8, top_k=2, num_expert_group=8, topk_group=4,
                                                       bias=True))


# ---------------------------------------------------------------------------------------------------------------
# GPU: serving sizes
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_routers_match_reference_gpu():
    device = torch.device("cuda")
    near_ties = 0
    for num_tokens in (1, 8192, 65536):
        for dtype in DTYPES.values():
            for num_experts, top_k in ((256, 8), (160, 6), (384, 32), (1024, 8)):
                seed = num_tokens + num_experts
                logits = _logits(num_tokens, num_experts, dtype, seed, device)
                bias = _bias(num_experts, seed, device) if num_experts != 256 else None
                mask = _mask(num_tokens, 0.3, seed, device)
                w, ids = topk_softmax(logits, top_k, True, is_padding=mask, bias=bias,
                                      out=_poisoned_out(num_tokens, top_k, device))
                res = compare_routing(w, ids, topk_softmax_reference(logits, top_k, True, is_padding=mask,
                                                                     bias=bias))
                assert res.ok, (num_tokens, dtype, num_experts, res.detail)
                near_ties += res.metrics["ids.near_tie_rows"]
            for scoring in ("sigmoid", "softmax"):
                logits = _logits(num_tokens, 256, dtype, num_tokens, device)
                bias = _bias(256, num_tokens, device)
                kwargs = dict(scoring=scoring, bias=bias, routed_scaling_factor=2.5,
                              is_padding=_mask(num_tokens, 0.3, 9, device))
                w, ids = grouped_topk(logits, 8, 8, 4, out=_poisoned_out(num_tokens, 8, device), **kwargs)
                res = compare_routing(w, ids, grouped_topk_reference(logits, 8, 8, 4, **kwargs))
                assert res.ok, (num_tokens, dtype, scoring, res.detail)
                near_ties += res.metrics["ids.near_tie_rows"]
    print(f"near-tie rows accepted: {near_ties}")
    # CUDA-graph capture and replay give the eager result
    logits = _logits(4096, 256, torch.bfloat16, 5, device)
    mask = _mask(4096, 0.5, 5, device)
    out = _poisoned_out(4096, 8, device)
    want = topk_softmax(logits, 8, True, is_padding=mask)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        topk_softmax(logits, 8, True, is_padding=mask, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        topk_softmax(logits, 8, True, is_padding=mask, out=out)
    for t in out:
        poison(t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])
