"""The routers' cand<M> selections (router_common.RouterConfig, topk_softmax's module docstring): the fast path
(coarse candidates resolved exactly) and its full-row fallback give the references' ids bit for bit, and the
verification sends exactly the rows it must to the fallback: ties at the K-th pick, constant and non-finite rows;
random rows stay on the fast path (fallback_flags, one flag per program).

Both tile orientations (router_cand.ROW_AXIS: Triton 3.6 and 3.9 pick different ones) run here under the
interpreter."""

from __future__ import annotations

import pytest
import torch

from moebench.bench.routers import grouped_topk_reference, topk_softmax_reference
from moebench.kernels._details import router_cand
from moebench.kernels._details.router_common import ROUTER_CONFIGS, RouterConfig, router_config
from moebench.kernels.grouped_topk import grouped_cand_programs, grouped_topk
from moebench.kernels.topk_softmax import cand_programs, topk_softmax
from router_helpers import (DTYPES, assert_same_as_reference, crafted_tie_logits, make_bias, make_logits, make_mask,
                            poisoned_out, tie_bias)

CAND_CONFIGS = sorted(name for name, cfg in ROUTER_CONFIGS.items() if cfg.extra_candidates is not None)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=[0, 1], ids=["rows-axis0", "rows-axis1"])
def row_axis(request, monkeypatch):
    monkeypatch.setattr(router_cand, "ROW_AXIS", request.param)
    return request.param


def softmax_run(logits, top_k, config, **kwargs):
    flags = torch.full((cand_programs(logits.shape[0], logits.shape[1], top_k, config),), -1, dtype=torch.int32)
    out = poisoned_out(logits.shape[0], top_k, logits.device)
    w, ids = topk_softmax(logits, top_k, kwargs.pop("renormalize", True), config=config, fallback_flags=flags,
                          out=out, **kwargs)
    assert (flags >= 0).all() and (flags <= 1).all()
    return w, ids, flags


def grouped_run(logits, top_k, groups, topk_group, config, **kwargs):
    flags = torch.full((grouped_cand_programs(logits.shape[0], logits.shape[1], groups, top_k, config),), -1,
                       dtype=torch.int32)
    w, ids = grouped_topk(logits, top_k, groups, topk_group, config=config, fallback_flags=flags,
                          out=poisoned_out(logits.shape[0], top_k, logits.device), **kwargs)
    return w, ids, flags


def test_cand_config_parsing():
    assert router_config("cand3:2048:16") == RouterConfig("cand3", 2048, 16)
    assert RouterConfig("cand3", 2048, 16).extra_candidates == 3 and ROUTER_CONFIGS["twopass"].extra_candidates is None
    assert ROUTER_CONFIGS["cand4"].extra_candidates == 4
    for bad in ("cand0:4096:32", "candx:4096:32", "cand:4096:32"):
        with pytest.raises(ValueError, match="router config"):
            router_config(bad)


SOFTMAX_SHAPES = [(256, 8, "bf16"), (160, 6, "fp32"), (520, 1, "fp16"), (40, 8, "bf16")]
# every M on every shape; the launch-shape variants (same code, other BLOCK_T / warps) on the serving shape
RANDOM_CASES = [(c, *shape) for c in CAND_CONFIGS for shape in SOFTMAX_SHAPES
                if "-" not in c or shape == SOFTMAX_SHAPES[0]]


@pytest.mark.parametrize("config,num_experts,top_k,dtype", RANDOM_CASES)
def test_topk_softmax_cand_random(device, config, num_experts, top_k, dtype):
    # fresh random logits, bias, mask: reference ids bit for bit, no fallback (M >= 4, or fp32 / biased rows)
    seed = num_experts + top_k
    logits = make_logits(33, num_experts, DTYPES[dtype], seed, device)
    for bias in (None, make_bias(num_experts, seed, device)):
        mask = make_mask(33, 0.3, seed, device)
        w, ids, flags = softmax_run(logits, top_k, config, bias=bias, is_padding=mask)
        assert_same_as_reference(w, ids, topk_softmax_reference(logits, top_k, True, is_padding=mask, bias=bias))
        if ROUTER_CONFIGS[config].extra_candidates >= 4 or dtype == "fp32" or bias is not None:
            assert flags.sum() == 0, flags


def test_topk_softmax_cand_fallback_triggers(device, row_axis):
    # one program each (16 rows of 256): random rows; one constant row among them; one row with the K-th pick
    # tied M + 1 ways; a NaN row; a row of +Inf; and a block where every row is padding (never read: no fallback)
    num_experts, top_k, config = 256, 8, "cand4"
    logits = make_logits(96, num_experts, torch.bfloat16, 9, device).float()
    logits[16 + 3] = 0.5
    logits[32 + 7, :12] = 20.0  # experts 0..11 tie on top: the K-th and the C-th pick truncate alike
    logits[48 + 1, 5] = NAN
    logits[64 + 2] = INF
    mask = torch.zeros(96, dtype=torch.bool, device=device)
    mask[80:] = True
    logits[80:] = 0.0  # constant rows, but padded
    for dtype in ("bf16", "fp32"):
        x = logits.to(DTYPES[dtype])
        w, ids, flags = softmax_run(x, top_k, config, is_padding=mask)
        assert flags.tolist() == [0, 1, 1, 1, 1, 0], (dtype, flags.tolist())
        assert_same_as_reference(w, ids, topk_softmax_reference(x, top_k, True, is_padding=mask))
    # with M + 2 tied the tie still reaches past the candidates; with only M tied behind the K-th it does not
    logits[32 + 7, :12] = 0.0
    logits[32 + 7, :11] = 20.0
    _, _, flags = softmax_run(logits, top_k, config, is_padding=mask)
    assert flags[2] == 0


@pytest.mark.parametrize("config", ["cand2", "cand8"])
@pytest.mark.parametrize("num_experts,top_k", [(40, 6), (256, 8), (100, 32), (200, 1)])
def test_topk_softmax_cand_crafted_ties(device, config, num_experts, top_k):
    # all-equal rows, tie blocks, +-0.0, ties made by the bias, wide tie groups: exact through the fallback
    logits = crafted_tie_logits(num_experts, device)
    for dtype in ("bf16", "fp32"):  # fp16 takes the bf16 code path (16-bit loads)
        x = logits.to(DTYPES[dtype])
        for bias in (None, tie_bias(num_experts, device)):
            w, ids, flags = softmax_run(x, top_k, config, bias=bias, renormalize=False)
            assert_same_as_reference(w, ids, topk_softmax_reference(x, top_k, False, bias=bias))
            if bias is None and top_k + ROUTER_CONFIGS[config].extra_candidates < num_experts:
                assert flags.max() == 1  # rows 0 and 6 are constant


@pytest.mark.parametrize("with_bias", [False, True])
def test_topk_softmax_cand_non_finite(device, with_bias):
    logits = make_logits(8, 64, torch.float32, 17, device)
    logits[1], logits[2], logits[3] = NAN, INF, -INF
    logits[4, 3], logits[5, 63], logits[6, 0] = NAN, INF, -INF
    bias = make_bias(64, 5, device) if with_bias else None
    for dtype in DTYPES.values():
        x = logits.to(dtype)
        w, ids, _ = softmax_run(x, 6, "cand2", bias=bias)
        assert torch.isfinite(w).all() and all(row.unique().numel() == 6 for row in ids)
        assert_same_as_reference(w, ids, topk_softmax_reference(x, 6, True, bias=bias))


GROUPED = [(256, 8, 4, 8), (160, 5, 2, 6), (48, 6, 4, 5), (96, 3, 3, 6), (64, 16, 4, 4), (64, 1, 1, 4)]


@pytest.mark.parametrize("config,shape", [(c, shape) for c in CAND_CONFIGS for shape in GROUPED
                                          if "-" not in c or shape == GROUPED[0]])
def test_grouped_topk_cand_random(device, config, shape):
    # 1 and 16 groups run the two-pass kernel under a cand config (grouped_topk.cand_shape_ok): same outputs
    num_experts, groups, topk_group, top_k = shape
    seed = num_experts + groups
    logits = make_logits(29, num_experts, torch.float32, seed, device)
    mask = make_mask(29, 0.25, seed, device)
    for scoring, bias in (("sigmoid", make_bias(num_experts, seed, device)), ("softmax", None)):
        kwargs = dict(scoring=scoring, bias=bias, routed_scaling_factor=2.5, is_padding=mask)
        w, ids, flags = grouped_run(logits, top_k, groups, topk_group, config, **kwargs)
        assert_same_as_reference(w, ids, grouped_topk_reference(logits, top_k, groups, topk_group, **kwargs))
        if 2 <= groups <= 8:
            assert flags.sum() == 0, flags


def test_grouped_topk_cand_fallback_and_ties(device, row_axis):
    # crafted ties (constant rows tie every group score: the kept groups need the fallback), non-finite rows,
    # both scorings, bias or none, a shape with padded groups and members
    for num_experts, groups, topk_group, top_k in ((256, 8, 4, 8), (96, 6, 3, 6)):
        logits = crafted_tie_logits(num_experts, device)
        logits[5, 3], logits[7] = NAN, INF
        for scoring in ("softmax", "sigmoid"):
            for bias in (None, tie_bias(num_experts, device)):
                kwargs = dict(scoring=scoring, bias=bias)
                w, ids, flags = grouped_run(logits, top_k, groups, topk_group, "cand2", **kwargs)
                assert flags.tolist() == [1]
                assert_same_as_reference(w, ids, grouped_topk_reference(logits, top_k, groups, topk_group, **kwargs))
    # random rows of the DeepSeek-V3 shape stay on the fast path in both orientations
    logits = make_logits(16, 256, torch.float32, 2, device)
    bias = make_bias(256, 2, device)
    w, ids, flags = grouped_run(logits, 8, 8, 4, "cand2", scoring="sigmoid", bias=bias)
    assert flags.tolist() == [0]
    assert_same_as_reference(w, ids, grouped_topk_reference(logits, 8, 8, 4, scoring="sigmoid", bias=bias))
