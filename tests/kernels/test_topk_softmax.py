"""topk_softmax: the Triton kernel against its eager-torch reference (docs/contracts.md "Routers"), and the argument
checks both routers share.

CPU runs use Triton's interpreter (tests/conftest.py) at small T; the @gpu test repeats the comparison (both
routers) at serving sizes. ids are compared exactly, weights by max/RMS relative error (<= 1e-5); outputs are
poisoned first."""

from __future__ import annotations

import pytest
import torch

from moebench.check import poison
from moebench.bench.routers import compare_routing, grouped_topk_reference, topk_softmax_reference
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch
from moebench.kernels.topk_softmax import topk_softmax, topk_softmax_torch
from moebench.kernels._details.router_common import (DEFAULT_ROUTER_CONFIG, ROUTER_CONFIGS, RouterConfig,
                                                     router_config)
from moebench.kernels.grouped_topk import grouped_choice
from moebench.kernels.topk_softmax import softmax_choice
from router_helpers import (DTYPES, assert_same_as_reference, crafted_tie_logits, make_bias, make_logits, make_mask,
                            poisoned_out, tie_bias)

# the crafted-tie tests run every selection, one launch shape each beyond the two-pass / packed pairs (the random
# and adversarial cases of every cand config are in test_router_cand)
CONFIGS_UNDER_TEST = ["twopass", "packed64", "twopass-16", "packed64-16", "cand2", "cand4-16"]


SHAPES = [(8, 1), (8, 2), (8, 6), (8, 8), (160, 6), (160, 8), (160, 32), (384, 2), (384, 32), (1024, 1),
          (1024, 8), (1024, 32)]


# one dtype a shape, chosen so that each dtype meets small and large E, K = 1 or 2 and K = 32, with and without bias,
# padding and renormalisation (the crafted-tie tests below run every dtype at every shape they take)
DTYPE_OF_SHAPE = "fp32 bf16 fp16 fp32 bf16 bf16 fp32 fp16 fp16 fp16 fp32 bf16".split()
DTYPE_CASES = [(e, k, dtype) for (e, k), dtype in zip(SHAPES, DTYPE_OF_SHAPE, strict=True)]


@pytest.mark.parametrize("num_experts,top_k,dtype", DTYPE_CASES)
def test_topk_softmax_matches_reference(device, dtype, num_experts, top_k):
    # 37 rows: not a multiple of any row block; bias / renormalize / padding vary with the shape
    case = SHAPES.index((num_experts, top_k))
    num_tokens = 37
    seed = 100 * case + len(dtype)
    logits = make_logits(num_tokens, num_experts, DTYPES[dtype], seed, device)
    bias = make_bias(num_experts, seed, device) if case % 2 else None
    renormalize = case % 3 != 1
    is_padding = make_mask(num_tokens, 0.3, seed, device) if case % 4 < 2 else None
    out = poisoned_out(num_tokens, top_k, device)
    weights, ids = topk_softmax(logits, top_k, renormalize, is_padding=is_padding, bias=bias, out=out)
    assert weights.data_ptr() == out[0].data_ptr() and ids.data_ptr() == out[1].data_ptr()
    ref = topk_softmax_reference(logits, top_k, renormalize, is_padding=is_padding, bias=bias)
    assert_same_as_reference(weights, ids, ref)
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
    logits = make_logits(24, 64, torch.float32, 7, device)
    bias = make_bias(64, 7, device)
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
    logits = make_logits(6, num_experts, torch.float32, 3, device, scale=0.5)
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
        assert_same_as_reference(w, ids, topk_softmax_reference(logits, top_k, True, bias=bias))


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


@pytest.mark.parametrize("config", CONFIGS_UNDER_TEST)
@pytest.mark.parametrize("num_experts,top_k", [(40, 6), (160, 6), (256, 8), (100, 32), (1000, 5)])
def test_topk_softmax_crafted_ties_every_config(device, config, num_experts, top_k):
    # exact ids against the stable-sort reference under every selection / launch config (non-power-of-two E, K=6)
    logits = crafted_tie_logits(num_experts, device)
    for dtype in DTYPES.values():
        x = logits.to(dtype)
        for bias in (None, tie_bias(num_experts, device)):
            w, ids = topk_softmax(x, top_k, True, bias=bias, config=config)
            assert_same_as_reference(w, ids, topk_softmax_reference(x, top_k, True, bias=bias))


@pytest.mark.parametrize("config", CONFIGS_UNDER_TEST)
def test_grouped_topk_crafted_ties_every_config(device, config):
    for num_experts, groups, topk_group, top_k in ((40, 5, 2, 6), (256, 8, 4, 8), (96, 12, 3, 6)):
        logits = crafted_tie_logits(num_experts, device)
        for scoring in ("softmax", "sigmoid"):
            for bias in (None, tie_bias(num_experts, device)):
                kwargs = dict(scoring=scoring, bias=bias)
                w, ids = grouped_topk(logits, top_k, groups, topk_group, config=config, **kwargs)
                assert_same_as_reference(w, ids, grouped_topk_reference(logits, top_k, groups, topk_group,
                                                                        **kwargs))


def test_router_config_selection():
    """No config: the rule (cand4, no table on the CPU), for each router under its own kernel name and bucket; a
    name or a "<selection>:<per program>:<per thread>" spec is explicit."""
    rule = softmax_choice(5000, 256, 8, "cpu")
    assert (rule.kernel, rule.name, rule.source, rule.bucket) == ("topk_softmax", DEFAULT_ROUTER_CONFIG, "rule",
                                                                  "T=8192,E=256,K=8")
    assert rule.config == ROUTER_CONFIGS[DEFAULT_ROUTER_CONFIG]
    grouped = grouped_choice(65536, 256, 8, 8, "cpu")
    assert (grouped.kernel, grouped.bucket, grouped.source) == ("grouped_topk", "T=65536,E=256,K=8,G=8", "rule")
    assert softmax_choice(8, 256, 8, "cpu", "twopass").source == "explicit"
    spec = softmax_choice(8, 256, 8, "cpu", "packed64:8192:32")
    assert (spec.name, spec.source, spec.config) == ("packed64:8192:32", "explicit", RouterConfig("packed64", 8192, 32))
    assert router_config("packed64:8192:32") == RouterConfig("packed64", 8192, 32)
    assert RouterConfig("packed64", 8192, 32).launch(256) == (32, 8)
    assert ROUTER_CONFIGS["twopass"].launch(256) == (16, 4) and ROUTER_CONFIGS["twopass"].launch(8) == (128, 1)
    for bad in ("fast", "packed32:4096:32", "twopass:4096", "twopass:0:32"):
        with pytest.raises(ValueError, match="router config"):
            router_config(bad)
        with pytest.raises(ValueError, match="router config"):
            softmax_choice(8, 256, 8, "cpu", bad)


@pytest.mark.parametrize("config", sorted(ROUTER_CONFIGS))
def test_every_router_config_matches_reference(device, config):
    """Every candidate of the routers' table, by name, on both routers (small shapes: the interpreter)."""
    logits = make_logits(40, 64, torch.bfloat16, 5, device)
    mask = make_mask(40, 0.25, 5, device)
    w, ids = topk_softmax(logits, 6, True, is_padding=mask, config=config)
    res = compare_routing(w, ids, topk_softmax_reference(logits, 6, True, is_padding=mask))
    assert res.ok, res.detail
    bias = make_bias(64, 5, device)
    kw = dict(scoring="sigmoid", bias=bias, routed_scaling_factor=2.5, is_padding=mask)
    w, ids = grouped_topk(logits, 6, 8, 4, config=config, **kw)
    res = compare_routing(w, ids, grouped_topk_reference(logits, 6, 8, 4, **kw))
    assert res.ok, res.detail


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
    logits = make_logits(num_tokens, num_experts, torch.bfloat16, 11, device)
    is_padding = {"random": make_mask(num_tokens, 0.4, 11, device),
                  "all": torch.ones(num_tokens, dtype=torch.bool, device=device),
                  "none": torch.zeros(num_tokens, dtype=torch.bool, device=device)}[fill]
    # NaN in padded rows must not reach anything: their logits are never read
    logits[is_padding] = float("nan")
    for fn in (topk_softmax, topk_softmax_torch):
        w, ids = fn(logits, top_k, True, is_padding=is_padding, out=poisoned_out(num_tokens, top_k, device))
        assert (ids[is_padding] == -1).all()
        assert (w[is_padding].view(torch.int32) == 0).all()  # +0.0 exactly
        assert (ids[~is_padding] >= 0).all() and torch.isfinite(w).all()
    w, ids = topk_softmax(logits, top_k, True, is_padding=is_padding)
    assert_same_as_reference(w, ids, topk_softmax_reference(logits, top_k, True, is_padding=is_padding))


def test_topk_softmax_none_mask_equals_no_padding_bitwise(device):
    logits = make_logits(33, 160, torch.float16, 5, device)
    bias = make_bias(160, 5, device)
    none_padded = torch.zeros(33, dtype=torch.bool, device=device)
    for fn in (topk_softmax, topk_softmax_torch):
        w0, i0 = fn(logits, 6, True, is_padding=None, bias=bias)
        w1, i1 = fn(logits, 6, True, is_padding=none_padded, bias=bias)
        assert torch.equal(i0, i1)
        assert torch.equal(w0.view(torch.int32), w1.view(torch.int32))


def test_router_mask_size_mismatch(device):
    logits = make_logits(7, 16, torch.float32, 1, device)
    short = torch.zeros(6, dtype=torch.bool, device=device)
    msg = r"^is_padding size mismatch, expected: 7, got: 6$"
    for fn in (topk_softmax, topk_softmax_torch):
        with pytest.raises(ValueError, match=msg):
            fn(logits, 2, True, is_padding=short)
    for fn in (grouped_topk, grouped_topk_torch):
        with pytest.raises(ValueError, match=msg):
            fn(logits, 2, 4, 2, is_padding=short)


def test_router_argument_errors(device):
    logits = make_logits(4, 16, torch.float32, 1, device)
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
        topk_softmax(make_logits(2, 64, torch.float32, 1, device), 33, True)
    with pytest.raises(ValueError, match="num_experts <= 1024"):
        topk_softmax(make_logits(2, 1025, torch.float32, 1, device), 2, True)
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


# The default launch (tuned table, else rule) on the GPU, one compile per case. T is no constexpr (do_not_specialize)
# and runs 1 / 8192 / 65536 wherever the config stays; only at E=256, K=8 does the bucket change it (on the H200:
# rule cand4 at T=1, table cand4 at 8192, cand2 at 65536), so there the T list picks the configs. Each (E, K) class
# and each dtype runs: bf16 at every T of E=256 (the config test's compiles), fp32 / fp16 each once at E=256 and
# once with a bias elsewhere (E=160: masked row tail; K=32, the slowest router compile, once; E=1024 at bf16).
# Every dtype at every shape runs on the CPU (test_topk_softmax_matches_reference).
ALL_T = (1, 8192, 65536)
GPU_SOFTMAX_CASES = [  # (dtype, num_experts, top_k, num_tokens to run)
    ("bf16", 256, 8, ALL_T), ("fp32", 256, 8, (65536,)), ("fp16", 256, 8, (1, 8192)),
    ("fp16", 160, 6, ALL_T), ("fp32", 384, 32, ALL_T), ("bf16", 1024, 8, ALL_T),
]
# grouped_topk (E=256, 8 groups keep 4, K=8, bias, scale 2.5, mask): every (dtype, scoring), (dtype, config) and
# (scoring, config) pair (rule cand4 at T=1, table cand2 at T >= 8192); bf16 sigmoid is the config test's launch.
GPU_GROUPED_CASES = [  # (dtype, scoring, num_tokens to run)
    ("bf16", "sigmoid", ALL_T), ("bf16", "softmax", (8192, 65536)), ("fp32", "softmax", (1,)),
    ("fp16", "sigmoid", (8192, 65536)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,num_experts,top_k,tokens", GPU_SOFTMAX_CASES,
                         ids=[f"{d}-E{e}-K{k}" for d, e, k, _ in GPU_SOFTMAX_CASES])
def test_topk_softmax_matches_reference_gpu(dtype_name, num_experts, top_k, tokens):
    # one case a test, so a parallel GPU run (`-n 4 --dist load`) spreads the compiles over its workers
    device = torch.device("cuda")
    dtype = DTYPES[dtype_name]
    for num_tokens in tokens:
        seed = num_tokens + num_experts
        logits = make_logits(num_tokens, num_experts, dtype, seed, device)
        bias = make_bias(num_experts, seed, device) if num_experts != 256 else None
        mask = make_mask(num_tokens, 0.3, seed, device)
        w, ids = topk_softmax(logits, top_k, True, is_padding=mask, bias=bias,
                              out=poisoned_out(num_tokens, top_k, device))
        res = compare_routing(w, ids, topk_softmax_reference(logits, top_k, True, is_padding=mask, bias=bias))
        assert res.ok, (num_tokens, dtype, num_experts, res.detail)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,scoring,tokens", GPU_GROUPED_CASES,
                         ids=[f"{d}-{s}" for d, s, _ in GPU_GROUPED_CASES])
def test_grouped_topk_matches_reference_gpu(dtype_name, scoring, tokens):
    device = torch.device("cuda")
    dtype = DTYPES[dtype_name]
    for num_tokens in tokens:
        logits = make_logits(num_tokens, 256, dtype, num_tokens, device)
        bias = make_bias(256, num_tokens, device)
        kwargs = dict(scoring=scoring, bias=bias, routed_scaling_factor=2.5,
                      is_padding=make_mask(num_tokens, 0.3, 9, device))
        w, ids = grouped_topk(logits, 8, 8, 4, out=poisoned_out(num_tokens, 8, device), **kwargs)
        res = compare_routing(w, ids, grouped_topk_reference(logits, 8, 8, 4, **kwargs))
        assert res.ok, (num_tokens, dtype, scoring, res.detail)


@pytest.mark.gpu
def test_router_cuda_graph_replay_gives_the_eager_result():
    device = torch.device("cuda")
    logits = make_logits(4096, 256, torch.bfloat16, 5, device)
    mask = make_mask(4096, 0.5, 5, device)
    out = poisoned_out(4096, 8, device)
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


@pytest.fixture(scope="module")
def serving_logits_gpu():
    device = torch.device("cuda")
    logits = make_logits(65536, 256, torch.bfloat16, 3, device)
    bias = make_bias(256, 3, device)
    mask = make_mask(65536, 0.25, 3, device)
    ref = topk_softmax_reference(logits, 8, True, is_padding=mask)
    gref = grouped_topk_reference(logits, 8, 8, 4, scoring="sigmoid", bias=bias, routed_scaling_factor=2.5,
                                  is_padding=mask)
    return logits, bias, mask, ref, gref


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(ROUTER_CONFIGS))
def test_router_configs_match_reference_gpu(config, serving_logits_gpu):
    # every router config at a serving size, on both routers (the H200 trial's correctness side); one config a
    # test, for a parallel GPU run
    logits, bias, mask, ref, gref = serving_logits_gpu
    w, ids = topk_softmax(logits, 8, True, is_padding=mask, config=config)
    res = compare_routing(w, ids, ref)
    assert res.ok, (config, res.detail)
    w, ids = grouped_topk(logits, 8, 8, 4, scoring="sigmoid", bias=bias, routed_scaling_factor=2.5,
                          is_padding=mask, config=config)
    res = compare_routing(w, ids, gref)
    assert res.ok, (config, res.detail)
