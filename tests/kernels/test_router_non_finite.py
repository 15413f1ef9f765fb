"""Both routers on non-finite logits (docs/contracts.md "Routers", non-finite logits): a NaN or +-Inf score after
the softmax / sigmoid is clamped to +0.0 before the bias and the selection, so such rows get distinct ids (the tie
rule on the clamped scores) and finite weights; the Triton kernels match the references exactly.

Rows: all NaN, all +Inf, all -Inf, one of each among finite logits, and a clean row; every dtype, with and without
a bias, both scorings of grouped_topk."""

from __future__ import annotations

import pytest
import torch

from moebench.bench.routers import grouped_topk_reference, topk_softmax_reference
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch
from moebench.kernels.topk_softmax import topk_softmax, topk_softmax_torch
from router_helpers import DTYPES, assert_same_as_reference, make_bias, make_logits, poisoned_out

NAN, INF = float("nan"), float("inf")


def poisoned_rows(num_experts: int, dtype: torch.dtype, device) -> torch.Tensor:
    """8 rows: clean, NaN, +Inf, -Inf, then one NaN / +Inf / -Inf in a clean row, then NaN and -Inf mixed."""
    logits = make_logits(8, num_experts, torch.float32, 17, device)
    logits[1], logits[2], logits[3] = NAN, INF, -INF
    logits[4, 3], logits[5, num_experts - 1], logits[6, 0] = NAN, INF, -INF
    logits[7, ::2], logits[7, 1::2] = NAN, -INF
    return logits.to(dtype)


def check_against_reference(w, ids, ref, top_k):
    assert torch.isfinite(w).all(), w
    assert all(row.unique().numel() == top_k for row in ids), ids
    assert_same_as_reference(w, ids, ref)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_experts,top_k", [(16, 4), (40, 6), (256, 8)])
def test_topk_softmax_non_finite_rows(device, dtype, with_bias, num_experts, top_k):
    logits = poisoned_rows(num_experts, DTYPES[dtype], device)
    bias = make_bias(num_experts, 5, device) if with_bias else None
    for renormalize in (False, True):
        w, ids = topk_softmax(logits, top_k, renormalize, bias=bias, out=poisoned_out(8, top_k, device))
        check_against_reference(w, ids, topk_softmax_reference(logits, top_k, renormalize, bias=bias), top_k)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shape", [(16, 4, 2, 4), (48, 6, 4, 5), (256, 8, 4, 8)])
def test_grouped_topk_non_finite_rows(device, dtype, with_bias, scoring, shape):
    num_experts, groups, topk_group, top_k = shape
    logits = poisoned_rows(num_experts, DTYPES[dtype], device)
    kwargs = dict(scoring=scoring, bias=make_bias(num_experts, 6, device) if with_bias else None,
                  routed_scaling_factor=2.5)
    w, ids = grouped_topk(logits, top_k, groups, topk_group, out=poisoned_out(8, top_k, device), **kwargs)
    check_against_reference(w, ids, grouped_topk_reference(logits, top_k, groups, topk_group, **kwargs), top_k)


def test_clamp_semantics_spelled_out(device):
    # the clamp, case by case, on both routers and their references
    e, k = 8, 3
    logits = torch.zeros(4, e, device=device)
    logits[0] = NAN  # softmax and sigmoid: every score NaN -> 0 -> the tie rule: 0, 1, 2 with weights 0
    logits[1] = INF  # softmax: inf - inf = NaN -> 0; sigmoid: 1 for every expert (finite, no clamp needed)
    logits[2] = -INF  # softmax: all -inf -> NaN -> 0; sigmoid: 0
    logits[3] = torch.arange(e, dtype=torch.float32, device=device)
    logits[3, 5] = -INF  # softmax: p = 0 there, the rest untouched
    bias = torch.zeros(e, device=device)
    bias[6] = 0.5  # with the clamp a NaN row ranks on the bias alone
    for fn in (topk_softmax_torch, topk_softmax):
        w, ids = fn(logits, k, False)
        assert ids[:3].tolist() == [[0, 1, 2]] * 3 and (w[:3] == 0).all(), (fn.__name__, ids, w)
        assert ids[3].tolist() == [7, 6, 4] and torch.isfinite(w).all()
        w, ids = fn(logits, k, True, bias=bias)
        assert ids[:3].tolist() == [[6, 0, 1]] * 3 and (w[:3] == 0).all(), (fn.__name__, ids, w)
    for fn in (grouped_topk_torch, grouped_topk):
        w, ids = fn(logits, k, 2, 1, scoring="sigmoid", renormalize=False)
        assert ids[:3].tolist() == [[0, 1, 2]] * 3, (fn.__name__, ids)
        assert w[0].tolist() == [0.0] * 3 and w[1].tolist() == [1.0] * 3 and w[2].tolist() == [0.0] * 3
        w, ids = fn(logits, k, 2, 1, scoring="softmax", renormalize=True, bias=bias)
        assert ids[:3].tolist() == [[6, 4, 5]] * 3 and (w[:3] == 0).all(), (fn.__name__, ids, w)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bad", [NAN, INF])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_vllm_style_poisoned_rows(device, dtype, bad, scoring):
    # vLLM's *_nan_inf_clamp cases: row 0 clean, rows 1-3 all NaN / +Inf; ids distinct and weights finite, with and
    # without a bias (the sigmoid router without groups is grouped_topk with one group)
    for num_experts in (6, 8, 16):
        for top_k in (3, 4):
            logits = make_logits(4, num_experts, DTYPES[dtype], 0, device)
            logits[1:] = bad
            for bias in (None, torch.randn(num_experts, generator=torch.Generator().manual_seed(1)).to(device)):
                if scoring == "softmax":
                    w, ids = topk_softmax(logits, top_k, False, bias=bias)
                else:
                    w, ids = grouped_topk(logits, top_k, 1, 1, scoring="sigmoid", bias=bias, renormalize=False)
                assert torch.isfinite(w).all()
                assert all(row.unique().numel() == top_k for row in ids)
