"""grouped_topk: the Triton kernel against its eager-torch reference (docs/contracts.md "Routers"): group scores,
group ties, scaling and renormalisation, padded rows.

CPU runs use Triton's interpreter (tests/conftest.py) at small T. ids are compared exactly, weights by max/RMS
relative error (<= 1e-5); outputs are poisoned first."""

from __future__ import annotations

import pytest
import torch

from moebench.bench.routers import grouped_topk_reference
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch
from router_helpers import (DTYPES, assert_same_as_reference, make_bias, make_logits, make_mask, poisoned_out)


GROUPED = [  # num_experts, num_expert_group, topk_group, top_k
    (256, 8, 4, 8), (160, 5, 2, 6), (64, 4, 2, 8), (384, 3, 2, 32), (48, 6, 4, 5), (64, 1, 1, 4), (1024, 16, 4, 8),
]


# two of the four (scoring, bias) pairs a shape, alternating in runs of three shapes, so that each pair meets
# every dtype (case % 3), with and without padding and renormalisation
PAIRS = ((("softmax", False), ("sigmoid", True)), (("softmax", True), ("sigmoid", False)))
SCORED = [(scoring, with_bias, shape) for case, shape in enumerate(GROUPED) for scoring, with_bias in PAIRS[case // 3 % 2]]


@pytest.mark.parametrize("scoring,with_bias,shape", SCORED)
def test_grouped_topk_matches_reference(device, scoring, with_bias, shape):
    num_experts, groups, topk_group, top_k = shape
    case = GROUPED.index(shape)
    num_tokens = 29
    dtype = list(DTYPES.values())[case % 3]
    seed = 1000 + 10 * case + with_bias
    logits = make_logits(num_tokens, num_experts, dtype, seed, device)
    bias = make_bias(num_experts, seed, device) if with_bias else None
    is_padding = make_mask(num_tokens, 0.25, seed, device) if case % 2 == 0 else None
    renormalize = case not in (3, 6)
    scale = 2.5 if case % 3 == 1 else 1.0
    kwargs = dict(scoring=scoring, bias=bias, renormalize=renormalize, routed_scaling_factor=scale,
                  is_padding=is_padding)
    out = poisoned_out(num_tokens, top_k, device)
    w, ids = grouped_topk(logits, top_k, groups, topk_group, out=out, **kwargs)
    ref = grouped_topk_reference(logits, top_k, groups, topk_group, **kwargs)
    assert_same_as_reference(w, ids, ref)
    # every chosen expert lies in one of topk_group groups
    live = ~is_padding if is_padding is not None else torch.ones(num_tokens, dtype=torch.bool, device=device)
    used = ids[live].long() // (num_experts // groups)
    assert all(row.unique().numel() <= topk_group for row in used)


def test_grouped_topk_weights_scaling_and_renormalize(device):
    logits = make_logits(16, 64, torch.float32, 21, device)
    bias = make_bias(64, 21, device)
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
    assert_same_as_reference(w, ids, grouped_topk_reference(logits, 4, 4, 2, scoring=scoring, bias=bias))


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
    logits = make_logits(40, 256, torch.bfloat16, 31, device)
    bias = make_bias(256, 31, device)
    mask = make_mask(40, 0.5, 31, device)
    logits[mask] = float("nan")
    w, ids = grouped_topk(logits, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=mask,
                          out=poisoned_out(40, 8, device))
    assert (ids[mask] == -1).all() and (w[mask].view(torch.int32) == 0).all()
    ref = grouped_topk_reference(logits, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=mask)
    assert_same_as_reference(w, ids, ref)
    clean = logits.clone()
    clean[mask] = 0.0
    none_padded = torch.zeros(40, dtype=torch.bool, device=device)
    for fn in (grouped_topk, grouped_topk_torch):
        w0, i0 = fn(clean, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=None)
        w1, i1 = fn(clean, 8, 8, 4, scoring="sigmoid", bias=bias, is_padding=none_padded)
        assert torch.equal(i0, i1) and torch.equal(w0.view(torch.int32), w1.view(torch.int32))
