"""prepare_moe_inputs (docs/contracts.md "Input staging"): Triton kernel vs the torch reference, the reference vs
the contract's own arithmetic, the padding contract, errors, and the oblivious twin.

On the CPU the kernel runs in Triton's interpreter, whose fp32 -> e4m3 cast rounds differently from the GPU: fp8
values are compared within those known deviations, everything else bitwise. The GPU tests at the end are bitwise
for all four outputs."""

import functools
import math

import pytest
import torch

from moebench.check import poison
from moebench.kernels import prepare_moe_inputs as prepare_moe_inputs_export
from moebench.kernels import prepare_moe_inputs_torch as prepare_moe_inputs_torch_export
from moebench.bench.staging import compare_staging, rows_differing
from moebench.kernels.prepare_moe_inputs import (alloc_outputs, prepare_moe_inputs, prepare_moe_inputs_oblivious,
                                                 prepare_moe_inputs_torch)


FORMATS = [(32, "ue8m0_packed"), (128, "ue8m0_packed"), (32, "fp32"), (128, "fp32")]


def make_inputs(T, H, K, *, num_experts=64, seed=0, device="cpu", plant_exact_pow2=True):
    """Random hidden rows at very different magnitudes (so scales vary), router ids/weights, a mask."""
    g = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** (torch.rand(T, 1, generator=g) * 6 - 3)  # 1e-3 .. 1e3
    hidden = torch.randn(T, H, generator=g) * row_scale
    if plant_exact_pow2 and T > 1 and H >= 32:
        # A group whose max is 3.5 = 448 * 2^-7: sf is exactly a power of two and must stay as it is.
        hidden[1, :32] = hidden[1, :32].clamp(-3.0, 3.0)
        hidden[1, 5] = -3.5
    if T > 2 and H >= 128:
        hidden[2, 64:96] = 0.0  # all-zero group: amax floor 1e-4
        hidden[2, 96:128] *= 1e-6 / hidden[2, 96:128].abs().max()  # amax 1e-6 < floor
    hidden = hidden.to(torch.bfloat16)
    topk_weights = torch.rand(T, K, generator=g) + 0.01
    topk_ids = torch.randint(0, num_experts, (T, K), generator=g, dtype=torch.int32)
    is_padding = torch.rand(T, generator=g) < 0.4
    is_padding[0] = False
    if T > 2:
        is_padding[-1] = True
    return hidden.to(device), topk_weights.to(device), topk_ids.to(device), is_padding.to(device)


def poisoned_outputs(T, H, K, G, fmt, device="cpu"):
    outs = alloc_outputs(T, H, K, G, fmt, device)
    for t in outs:
        poison(t)
    return outs


def test_exports():
    assert prepare_moe_inputs_export is prepare_moe_inputs
    assert prepare_moe_inputs_torch_export is prepare_moe_inputs_torch
    assert prepare_moe_inputs.oblivious is prepare_moe_inputs_oblivious


@pytest.mark.parametrize("group_size,scale_format", FORMATS)
def test_kernel_matches_reference(group_size, scale_format):
    T, H, K = 9, 1024, 6
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K)
    outs = poisoned_outputs(T, H, K, group_size, scale_format)
    got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format, out=outs)
    assert all(a is b for a, b in zip(got, outs))
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format)
    res = compare_staging(got, ref, bitwise=False)
    assert res.ok, res.detail
    # The interpreter's cast deviates on ties / binade carries only: most values are bit-identical.
    assert res.metrics["x_fp8.exact_fraction"] > 0.85
    # Padded rows: -1 / 0.0 in every slot; real rows unchanged.
    assert (got[2][is_padding] == -1).all() and (got[3][is_padding] == 0.0).all()
    assert torch.equal(got[2][~is_padding], topk_ids[~is_padding].long())
    assert torch.equal(got[3][~is_padding], topk_weights[~is_padding])


@pytest.mark.parametrize("group_size,scale_format", FORMATS)
def test_reference_follows_spec_arithmetic(group_size, scale_format):
    """The reference against docs/contracts.md#staging computed another way: float64 logs for UE8M0, byte unpacking by hand,
    dequantised values close to the input."""
    T, H, K = 5, 512, 2
    hidden, topk_weights, topk_ids, _ = make_inputs(T, H, K, seed=3)
    hidden[2, 64:96] = 0  # one all-zero group: amax floor 1e-4
    x_fp8, x_sf, _, _ = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, None, group_size, scale_format)
    groups = hidden.double().reshape(T, H // group_size, group_size)
    amax = groups.abs().amax(dim=2).clamp_min(float(torch.tensor(1e-4, dtype=torch.float32)))
    if scale_format == "ue8m0_packed":
        assert x_sf.shape == (T, H // (4 * group_size)) and x_sf.dtype == torch.int32
        words = x_sf.to(torch.int64) & 0xFFFFFFFF
        e = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).reshape(T, H // group_size)
        # bf16 amax / 448 is never within fp32 rounding of a power of two unless it is one, so the exact ceil
        # of log2 in float64 is the contract's bit rule.
        expect_e = torch.ceil(torch.log2(amax / 448.0)).long() + 127
        assert torch.equal(e, expect_e)
        assert e[1, 0] == 127 - 7  # the planted 3.5-max group: sf = 2^-7 exactly, not rounded up
        sf = torch.pow(2.0, (e - 127).double())
    else:
        assert x_sf.shape == (T, H // group_size) and x_sf.dtype == torch.float32
        assert torch.equal(x_sf, (amax.float() / torch.tensor(448.0)))
        sf = x_sf.double()
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == (T, H)
    q = x_fp8.double().reshape(T, H // group_size, group_size)
    assert q.abs().max() <= 448.0
    deq = q * sf.unsqueeze(2)
    # e4m3 keeps 3 mantissa bits: half an ulp is <= 2^-4 relative, plus the subnormal step 2^-9 * sf.
    assert ((deq - groups).abs() <= groups.abs() * 2.0 ** -4 + sf.unsqueeze(2) * 2.0 ** -10).all()
    assert (q.abs().amax(dim=2)[amax > 1e-3] >= 224).all()  # the scale uses the range: max lands in [224, 448]


def test_packed_word_layout_little_endian():
    """Word j = e[4j] | e[4j+1] << 8 | ...: checked on hand-made groups with known exponents."""
    G, T = 32, 1
    maxima = [448.0 * 2.0 ** k for k in (-10, -3, 0, 2)]  # exact powers of two -> e = 127 + k
    hidden = torch.rand(T, 4 * G)
    for j, m in enumerate(maxima):
        hidden[0, j * G:(j + 1) * G] *= 0.9 * m
        hidden[0, j * G + 3] = -m
    hidden = hidden.to(torch.bfloat16)
    w, ids = torch.rand(T, 1), torch.zeros(T, 1, dtype=torch.int32)
    e = [127 + k for k in (-10, -3, 0, 2)]
    expect = e[0] | e[1] << 8 | e[2] << 16 | e[3] << 24
    expect = expect - 2**32 if expect >= 2**31 else expect
    for fn in (prepare_moe_inputs, prepare_moe_inputs_torch):
        _, x_sf, _, _ = fn(hidden, w, ids, None, G, "ue8m0_packed")
        assert x_sf.tolist() == [[expect]], fn.__name__


def test_packed_word_sign_bit():
    """A top exponent byte >= 128 sets the int32 sign bit (scale >= 2, i.e. amax >= 896): bits, not value."""
    G, T = 32, 2
    hidden = torch.randn(T, 4 * G)
    hidden[:, 3 * G] = 5000.0  # group 3: sf = 2^4 -> e = 131 in the top byte
    hidden = hidden.to(torch.bfloat16)
    w, ids = torch.rand(T, 2), torch.randint(0, 8, (T, 2), dtype=torch.int32)
    outs = poisoned_outputs(T, 4 * G, 2, G, "ue8m0_packed")
    got = prepare_moe_inputs(hidden, w, ids, None, G, "ue8m0_packed", out=outs)
    ref = prepare_moe_inputs_torch(hidden, w, ids, None, G, "ue8m0_packed")
    assert (ref[1] < 0).all() and ((ref[1].long() >> 24) & 0xFF == 131).all()
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("T,H,K", [(1, 512, 1), (3, 1536, 8), (40, 2048, 6)])
def test_odd_shapes_multi_program(T, H, K):
    """Shapes where the flat group space ends mid-program and the route part spans programs (T*K > 128)."""
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=T)
    for G, fmt in ((32, "ue8m0_packed"), (128, "fp32")):
        outs = poisoned_outputs(T, H, K, G, fmt)
        got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, G, fmt, out=outs,
                                 tune=(1024, 4))
        ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, G, fmt)
        res = compare_staging(got, ref, bitwise=False)
        assert res.ok, res.detail


def test_fp32_format_needs_only_group_multiple():
    T, H, K = 4, 32 * 5, 3  # 160: a multiple of 32 but not of 128
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=5)
    got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, 32, "fp32", out=poisoned_outputs(T, H, K, 32,
                                                                                                         "fp32"))
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, 32, "fp32")
    assert compare_staging(got, ref, bitwise=False).ok
    for fn in (prepare_moe_inputs, prepare_moe_inputs_torch):
        with pytest.raises(ValueError, match="multiple of 4\\*group_size"):
            fn(hidden, topk_weights, topk_ids, is_padding, 32, "ue8m0_packed")


def test_none_mask_equals_unmasked_bitwise():
    T, H, K = 6, 512, 4
    hidden, topk_weights, topk_ids, _ = make_inputs(T, H, K, seed=7)
    no_padding = torch.zeros(T, dtype=torch.bool)
    for G, fmt in FORMATS[:2] + FORMATS[2:3]:
        a = prepare_moe_inputs(hidden, topk_weights, topk_ids, None, G, fmt, out=poisoned_outputs(T, H, K, G, fmt))
        b = prepare_moe_inputs(hidden, topk_weights, topk_ids, no_padding, G, fmt,
                               out=poisoned_outputs(T, H, K, G, fmt))
        for x, y in zip(a, b):
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
        assert torch.equal(a[2], topk_ids.long()) and torch.equal(a[3].view(torch.int32),
                                                                   topk_weights.view(torch.int32))
        ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, None, G, fmt)
        assert torch.equal(a[1], ref[1])


def test_padded_rows_still_staged_whole():
    """Padded rows keep their fp8 values and scales (rows are staged whole); only ids/weights are masked."""
    T, H, K = 8, 512, 3
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=11)
    assert is_padding.any()
    masked = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, out=poisoned_outputs(T, H, K, 32,
                                                                                                "ue8m0_packed"))
    plain = prepare_moe_inputs(hidden, topk_weights, topk_ids, None, out=poisoned_outputs(T, H, K, 32,
                                                                                         "ue8m0_packed"))
    assert torch.equal(masked[0].view(torch.uint8), plain[0].view(torch.uint8))
    assert torch.equal(masked[1], plain[1])
    assert not torch.isnan(masked[0][is_padding].float()).any()


def test_weights_bits_and_int64_ids_pass_through():
    """Weights are copied by bits (negative, -0.0 and NaN payloads survive on real rows); int64 ids work."""
    T, H, K = 4, 128, 2
    hidden, _, _, _ = make_inputs(T, H, K, seed=13)
    topk_weights = torch.tensor([[-0.0, 1.5], [float("nan"), -2.0], [3.0, 0.25], [7.0, 8.0]])
    topk_ids = torch.tensor([[0, 5], [-1, 3], [2**40, 1], [4, 4]], dtype=torch.int64)
    is_padding = torch.tensor([False, False, False, True])
    got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, out=poisoned_outputs(T, H, K, 32,
                                                                                             "ue8m0_packed"))
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding)
    assert torch.equal(got[2], ref[2]) and got[2][2, 0] == 2**40 and (got[2][3] == -1).all()
    assert torch.equal(got[3].view(torch.int32), ref[3].view(torch.int32))
    assert got[3][0, 0].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)


def test_empty_batch_returns_without_launching(monkeypatch):
    import sys

    mod = sys.modules["moebench.kernels.prepare_moe_inputs"]  # the package re-exports a function of that name

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched for T == 0")

    monkeypatch.setattr(mod, "_prepare_moe_inputs_kernel", NoLaunch())
    hidden = torch.empty(0, 512, dtype=torch.bfloat16)
    w, ids = torch.empty(0, 8), torch.empty(0, 8, dtype=torch.int32)
    for fn in (prepare_moe_inputs, prepare_moe_inputs_oblivious, prepare_moe_inputs_torch):
        for G, fmt in FORMATS:
            x, sf, idx, tw = fn(hidden, w, ids, torch.zeros(0, dtype=torch.bool), G, fmt)
            sf_cols = 512 // (4 * G) if fmt == "ue8m0_packed" else 512 // G
            assert x.shape == (0, 512) and x.dtype == torch.float8_e4m3fn
            assert sf.shape == (0, sf_cols) and sf.dtype == (torch.int32 if fmt == "ue8m0_packed" else torch.float32)
            assert idx.shape == (0, 8) and idx.dtype == torch.int64 and tw.shape == (0, 8)


def test_mask_size_mismatch_is_an_error():
    T, H, K = 7, 256, 4
    hidden, topk_weights, topk_ids, _ = make_inputs(T, H, K)
    for bad_len in (T - 1, T + 1, 2 * T):
        for fn in (prepare_moe_inputs, prepare_moe_inputs_torch):
            with pytest.raises(ValueError, match=f"^is_padding size mismatch, expected: {T}, got: {bad_len}$"):
                fn(hidden, topk_weights, topk_ids, torch.zeros(bad_len, dtype=torch.bool))


def test_argument_errors():
    T, H, K = 4, 256, 2
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K)
    with pytest.raises(ValueError, match="group_size"):
        prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, group_size=48)
    with pytest.raises(ValueError, match="scale_format"):
        prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, scale_format="ue8m0")
    with pytest.raises(ValueError, match="topk_weights"):
        prepare_moe_inputs(hidden, topk_weights[:, :1], topk_ids, is_padding)
    with pytest.raises(ValueError, match="out x_sf"):
        outs = list(alloc_outputs(T, H, K))
        outs[1] = torch.empty(T, H // 32, dtype=torch.float32)
        prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, out=tuple(outs))


def test_oblivious_keeps_router_ids_on_padded_rows():
    T, H, K = 10, 256, 4
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=17)
    num_padded = int(is_padding.sum())
    assert num_padded >= 2
    got = prepare_moe_inputs_oblivious(hidden, topk_weights, topk_ids, is_padding,
                                       out=poisoned_outputs(T, H, K, 32, "ue8m0_packed"))
    pre_fix = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, None)
    assert compare_staging(got, pre_fix, bitwise=False).ok
    fixed = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding)
    assert (got[2][is_padding] >= 0).all()  # padded rows still routed to real experts
    assert rows_differing(got[2], got[3], fixed[2], fixed[3]) == num_padded


# Pairwise over (shape, group size, scale layout): the serving shape under all four layouts, each edge shape (one
# row, a short tail program, K=6, odd T with K=1) under two that differ in both group size and layout.
GPU_SHAPE_FORMATS = [((8192, 7168, 8), fmt) for fmt in FORMATS] + [
    ((1, 7168, 8), (32, "ue8m0_packed")), ((1, 7168, 8), (128, "fp32")),
    ((3, 512, 6), (128, "ue8m0_packed")), ((3, 512, 6), (32, "fp32")),
    ((1000, 2048, 6), (32, "ue8m0_packed")), ((1000, 2048, 6), (128, "fp32")),
    ((4097, 4096, 1), (128, "ue8m0_packed")), ((4097, 4096, 1), (32, "fp32"))]


@functools.lru_cache(maxsize=None)
def gpu_inputs(T, H, K):
    """make_inputs on the GPU, once per shape (the layouts of a shape share them; nothing writes them)."""
    return make_inputs(T, H, K, num_experts=256, seed=T + H, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K,group_size,scale_format", [(*shape, *fmt) for shape, fmt in GPU_SHAPE_FORMATS])
def test_gpu_bitwise(T, H, K, group_size, scale_format):
    if H % (4 * group_size) and scale_format == "ue8m0_packed":
        pytest.skip("not a valid packed shape")
    hidden, topk_weights, topk_ids, is_padding = gpu_inputs(T, H, K)
    outs = poisoned_outputs(T, H, K, group_size, scale_format, "cuda")
    got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format, out=outs)
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format)
    res = compare_staging(got, ref, bitwise=True)
    assert res.ok, res.detail
    # The CUDA reference equals the CPU reference bit for bit (both divide exactly).
    rows = torch.arange(0, T, max(1, T // 64), device="cuda")
    cpu = prepare_moe_inputs_torch(hidden[rows].cpu(), topk_weights[rows].cpu(), topk_ids[rows].cpu(),
                                   is_padding[rows].cpu(), group_size, scale_format)
    assert compare_staging(tuple(t[rows] for t in ref), cpu, bitwise=True).ok


@pytest.mark.gpu
def test_gpu_bitwise_edge_values():
    """Tiny groups (amax floor), huge values, planted exact powers of two, and many ties (x = 448*sf*k/16)."""
    T, H, K = 64, 1024, 8
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=99, device="cuda")
    hidden[3] = 1e-7
    hidden[4] = 3.0e4
    hidden[5] = (torch.arange(H, device="cuda") % 64 - 32).to(torch.bfloat16) * 0.125  # exact grid values
    for G, fmt in FORMATS:
        got = prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, G, fmt,
                                 out=poisoned_outputs(T, H, K, G, fmt, "cuda"))
        ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, G, fmt)
        res = compare_staging(got, ref, bitwise=True)
        assert res.ok, (G, fmt, res.detail)


@pytest.mark.gpu
def test_gpu_graph_capture_and_tune_variants():
    T, H, K = 512, 7168, 8
    hidden, topk_weights, topk_ids, is_padding = make_inputs(T, H, K, seed=5, device="cuda")
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding)
    for tune in [(2048, 4), (4096, 4), (8192, 8), (16384, 8)]:
        outs = poisoned_outputs(T, H, K, 32, "ue8m0_packed", "cuda")
        prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, out=outs, tune=tune)  # compile
        for t in outs:
            poison(t)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepare_moe_inputs(hidden, topk_weights, topk_ids, is_padding, out=outs, tune=tune)
        graph.replay()
        torch.cuda.synchronize()
        res = compare_staging(outs, ref, bitwise=True)
        assert res.ok, (tune, res.detail)


def test_shapes_helper_consistent():
    outs = alloc_outputs(3, 1024, 5, 128, "ue8m0_packed")
    assert [tuple(t.shape) for t in outs] == [(3, 1024), (3, 2), (3, 5), (3, 5)]
    assert math.prod(outs[0].shape) == 3 * 1024
