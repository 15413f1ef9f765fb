"""fused_experts_fp8 and its quantisers against the dequantised reference (fused_experts_fp8_ref).

CPU runs go through Triton's interpreter at small shapes (E=4, H=256 or 512, I=128). The interpreter's own
fp32 -> e4m3 cast loses the carry into the next binade (124.4 -> 64); the kernels round in fp32 arithmetic first
when interpreting (fp8_quant.to_e4m3 SOFT), so the quantisers are compared bitwise here too, and the @gpu tests
compare the hardware cast bitwise.

Error bound: elementwise, derived in fused_experts_fp8_ref's docstring (fp32 accumulation of both GEMMs, e4m3
flips of the re-quantised activation where the GEMM-1 difference can cross a rounding midpoint, bf16 stores);
its max / RMS relative limits are that bound's, per shape. Measured on the CPU (T=16 and 64, K=2, E=4, H=256
(512 for packed group 128), I=128, three layouts): max_rel 2.9e-3 .. 5.8e-3 (bound 1.2e-2 .. 2.1e-2), rms_rel
1.9e-3 .. 2.2e-3 (bound 1.8e-2 .. 3.0e-2), worst element at 0.62 of its own bound. The bf16 stores dominate:
under the interpreter GEMM 1 differs by ~1e-6, so almost no re-quantised element can flip.
"""

import dataclasses
import functools

import pytest
import torch

from moebench.check import poison
from moebench.kernels.fp8_quant import (
    E4M3,
    dequantize_staged,
    dequantize_weights,
    quantize_weights_fp8_block,
    quantize_weights_fp8_block_torch,
    requantize_rows_fp8,
    requantize_rows_fp8_torch,
    staged_scales,
)
from moebench.inputs.weights import make_expert_weights
from moebench.kernels.fused_experts import fused_experts_torch
from moebench.kernels.fused_experts_fp8 import (
    FP8_CANDIDATES,
    choose_fp8_config,
    fp8_choice,
    fused_experts_fp8,
    make_fp8_workspace,
)
from moebench.bench.experts_fp8 import check_within_bound
from moebench.kernels.fused_experts_fp8_ref import (
    error_model,
    fp8_reference_with_bound,
    fused_experts_fp8_torch,
    kernel_view_of_x,
    requant_deviation,
)
from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs_torch

E, H, I = 4, 256, 128
FORMATS = [(128, "fp32"), (32, "ue8m0_packed"), (128, "ue8m0_packed")]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def _hard_values(rows, cols, seed=0):
    """Activations with rounding ties, values whose e4m3 mantissa rounds up into the next binade (124.4 with a
    group max of 448 -> 128), subnormal results, all-zero groups, and magnitudes over 7 decades."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, cols, generator=g) * torch.logspace(-5, 2, rows)[:, None]
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact midpoints of e4m3 (with scale 1: the group max is 448)
    a[0, :] = 0.0
    a[1, :mids.numel()] = mids[:cols]
    a[1, -1] = 448.0
    a[2, :4] = torch.tensor([124.4, -124.4, 0.01, 448.0])
    return a


def test_requantizer_bitwise_and_scales_exact(device):
    a = _hard_values(40, 256).to(device)
    q, s = requantize_rows_fp8(a)
    q_ref, s_ref = requantize_rows_fp8_torch(a)
    assert torch.equal(_bits(s), _bits(s_ref))
    assert torch.equal(_bits(q), _bits(q_ref))
    assert q[2, 0].float().item() == 128.0  # the carry the interpreter's own cast drops
    assert (q[1, 1:120].float() != 0).all() and (q[0].float() == 0).all()


def test_weight_quantizer_bitwise(device):
    w13, _ = make_expert_weights(2, 256, 192, seed=1, device="cpu")
    w = w13.to(device)
    w[1, :128, :128] = 0  # an all-zero block: the amax floor, no division by zero
    q, s = quantize_weights_fp8_block(w)
    q_ref, s_ref = quantize_weights_fp8_block_torch(w)
    assert torch.equal(_bits(s), _bits(s_ref)) and torch.equal(_bits(q), _bits(q_ref))
    assert s.shape == (2, 384 // 128, 256 // 128)
    # dequantised within e4m3's rounding (half a step, 2^-4 relative) of each weight, blocks scale-limited below
    err = (dequantize_weights(q, s) - w.float()).abs()
    assert (err <= 2 ** -4 * w.float().abs() + s.repeat_interleave(128, 1).repeat_interleave(128, 2) * 2 ** -10).all()


def test_staged_scales_unpack():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    ids, w = torch.zeros(8, 1, dtype=torch.int32), torch.ones(8, 1)
    _, sf32, _, _ = prepare_moe_inputs_torch(x, w, ids, None, 32, "fp32")
    xq, packed, _, _ = prepare_moe_inputs_torch(x, w, ids, None, 32, "ue8m0_packed")
    s = staged_scales(packed, 32, "ue8m0_packed", 512)
    # UE8M0 is the fp32 scale rounded up to a power of two
    assert (s >= sf32).all() and (s < 2 * sf32).all() and (torch.frexp(s).mantissa == 0.5).all()
    deq = dequantize_staged(xq, packed, 32, "ue8m0_packed")
    assert ((deq - x.float()).abs() <= 2 ** -4 * x.float().abs() + s.repeat_interleave(32, 1) * 2 ** -10).all()


def _problem(device, T, K, G, fmt, *, seed=0, h=H, i=I, pad_rows=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g).to(torch.bfloat16)
    x[:, :32] *= 8  # sub-groups with different exponents in a K step: the UE8M0 alignment has work to do
    w13, w2 = make_expert_weights(E, h, i, seed=seed, device="cpu")
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:K] for _ in range(T)]).to(torch.int32)  # E, E+1: non-local
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    is_padding = torch.zeros(T, dtype=torch.bool)
    is_padding[T - pad_rows:] = True
    w = torch.rand(T, K, generator=g) + 0.05
    x_q, x_sf, staged_ids, staged_w = prepare_moe_inputs_torch(x, w, ids, is_padding, G, fmt)
    w13_q, w13_s = quantize_weights_fp8_block_torch(w13)
    w2_q, w2_s = quantize_weights_fp8_block_torch(w2)
    return [t.to(device) for t in (x_q, x_sf, staged_ids, staged_w, w13_q, w13_s, w2_q, w2_s)]


@pytest.mark.parametrize("G,fmt", FORMATS)
@pytest.mark.parametrize("T", [16, 64])
def test_fused_experts_fp8_within_derived_bound(device, G, fmt, T):
    h = 512 if fmt == "ue8m0_packed" and G == 128 else H  # the packed layout needs H % (4 * G) == 0
    args = _problem(device, T, 2, G, fmt, seed=T + G, h=h)
    x_q, x_sf, ids, w, w13_q, w13_s, w2_q, w2_s = args
    assert (ids < 0).any() and (ids >= E).any() and ((ids >= 0) & (ids < E)).any()
    ws = make_fp8_workspace(T, 2, E, h, I, device=device)
    for t in (ws.act, ws.act_scales, ws.y):
        poison(t)
    out = poison(torch.empty(T, h, dtype=torch.bfloat16, device=device))
    fused_experts_fp8(*args, group_size=G, scale_format=fmt, workspace=ws, out=out)
    ref, bound = fp8_reference_with_bound(*args, group_size=G, scale_format=fmt,
                                          model=error_model(torch.device(device), h, I))
    res = check_within_bound("out", out.float(), ref, bound)
    assert res.ok, res.detail
    m = res.metrics
    print(f"T={T} G={G} {fmt}: max_rel {m['out.max_rel']:.3g} (bound {m['out.bound_max_rel']:.3g}), "
          f"rms_rel {m['out.rms_rel']:.3g} (bound {m['out.bound_rms_rel']:.3g}), ratio {m['out.bound_ratio']:.3g}")
    assert m["out.bound_max_rel"] < 0.05  # the derived bound is itself a few bf16 steps, not a loose tolerance
    # padded rows and rows with only skipped routes: exactly zero; skipped routes: no y row written
    empty = ~((ids >= 0) & (ids < E)).any(dim=1)
    assert empty[-4:].all() and (out[empty] == 0).all()
    placed = ((ids >= 0) & (ids < E)).reshape(-1)
    assert torch.isnan(ws.y[~placed].float()).all() and torch.isfinite(ws.y[placed].float()).all()
    # the eager reference in bf16 lands within the same bound
    assert check_within_bound("torch", fused_experts_fp8_torch(*args, group_size=G, scale_format=fmt).float(),
                              ref, bound).ok


@pytest.mark.parametrize("G,fmt", FORMATS[:2])
def test_requantised_activation_matches_reference(device, G, fmt):
    """The gate/up stage alone: the workspace's e4m3 act (x its scales) per sorted position against the
    reference's re-quantised SwiGLU output, within requant_deviation's bound, and almost every e4m3 code
    bit-identical (a code may only differ where GEMM 1's fp32 differences move it across a rounding midpoint)."""
    T, K = 32, 2
    args = _problem(device, T, K, G, fmt, seed=5)
    x_q, x_sf, ids, w, w13_q, w13_s, w2_q, w2_s = args
    ws = make_fp8_workspace(T, K, E, H, I, device=device)
    poison(ws.act)
    fused_experts_fp8(*args, group_size=G, scale_format=fmt, workspace=ws)
    bm = ws.config.block_m
    x = kernel_view_of_x(x_q, x_sf, G, fmt)
    x_exact = dequantize_staged(x_q, x_sf, G, fmt)
    model = error_model(torch.device(device), H, I)
    n = int(ws.num_post.item())
    checked = exact = 0
    for b in range(n // bm):
        e = int(ws.expert_ids[b])
        routes = ws.sorted_ids[b * bm:(b + 1) * bm].long()
        ok = routes < T * K
        pos = torch.arange(b * bm, (b + 1) * bm, device=routes.device)[ok]
        rows = x_exact[routes[ok] // K]
        w1 = dequantize_weights(w13_q[e], w13_s[e])
        hh = rows @ w1.T
        a = torch.nn.functional.silu(hh[:, :I]) * hh[:, I:]
        q_ref, s_ref = requantize_rows_fp8_torch(a)
        got = ws.act[pos].float() * ws.act_scales[pos].repeat_interleave(128, 1)
        want = q_ref.float() * s_ref.repeat_interleave(128, 1)
        dh = model.gemm1_rel * (rows.abs() @ w1.abs().T) + (x[routes[ok] // K] - rows).abs() @ w1.abs().T
        g, u, dg, du = hh[:, :I], hh[:, I:], dh[:, :I], dh[:, I:]
        da = 1.1 * u.abs() * dg + torch.nn.functional.silu(g).abs() * du + 1.1 * dg * du + 2 ** -21 * a.abs()
        assert ((got - want).abs() <= requant_deviation(a, da, 128) + 1e-30).all()
        checked += got.numel()
        exact += int((_bits(ws.act[pos]) == _bits(q_ref)).sum())  # the scales may differ by an fp32 ulp
    assert checked > 0 and exact >= 0.99 * checked


def test_bound_catches_a_missing_requantisation():
    """The bound is tight enough to tell: the same experts computed without re-quantising the activation
    (the bf16 reference on the dequantised inputs) fall outside it."""
    args = _problem("cpu", 64, 2, 128, "fp32", seed=11)
    x_q, x_sf, ids, w, w13_q, w13_s, w2_q, w2_s = args
    ref, bound = fp8_reference_with_bound(*args, group_size=128, scale_format="fp32",
                                          model=error_model(torch.device("cpu"), H, I))
    no_requant = fused_experts_torch(dequantize_staged(x_q, x_sf, 128, "fp32"), dequantize_weights(w13_q, w13_s),
                                     dequantize_weights(w2_q, w2_s), w, ids, out_dtype=torch.float32)
    assert not check_within_bound("out", no_requant.to(torch.bfloat16).float(), ref, bound).ok


def test_ue8m0_alignment_view_is_exact_for_normal_values():
    x_q, x_sf, *_ = _problem("cpu", 16, 1, 32, "ue8m0_packed", seed=2)
    view = kernel_view_of_x(x_q, x_sf, 32, "ue8m0_packed")
    exact = dequantize_staged(x_q, x_sf, 32, "ue8m0_packed")
    s = staged_scales(x_sf, 32, "ue8m0_packed", H).repeat_interleave(32, 1)
    differs = view != exact
    assert differs.float().mean() < 0.05  # only values pushed below e4m3's normal range round
    s_max = s.reshape(16, H // 128, 128).amax(dim=2, keepdim=True).expand(-1, -1, 128).reshape(16, H)
    assert ((view - exact).abs() <= s_max * 2 ** -10).all()


def test_argument_errors():
    args = _problem("cpu", 8, 1, 128, "fp32")
    with pytest.raises(ValueError, match="group_size 32 with ue8m0_packed"):
        fused_experts_fp8(*args, group_size=32, scale_format="fp32")
    with pytest.raises(ValueError, match="x_scales"):
        fused_experts_fp8(*args, group_size=256, scale_format="fp32")
    bad = list(args)
    bad[4] = bad[4].float()
    with pytest.raises(ValueError, match="w13_q"):
        fused_experts_fp8(*bad, group_size=128, scale_format="fp32")
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_weights_fp8_block(torch.zeros(1, 100, 128))


def test_fp8_rule_and_candidates(monkeypatch):
    """The rule's tiers by rows per expert; every candidate by name (explicit), fitted to H, within the register
    budget; an unknown name is a one-line error naming the table."""
    import moebench.kernels._details.experts_config as mod  # the rules of both precisions

    monkeypatch.setattr(mod, "interpreting", lambda: False)
    assert choose_fp8_config(32768, 128, 7168, 2048).name == "bm128_w8r"  # 256 rows per expert
    assert choose_fp8_config(32767, 128, 7168, 2048).name == "bm64_s4"
    assert choose_fp8_config(256, 128, 7168, 2048).block_m == 16
    rule = fp8_choice(4096, 8, 128, 7168, 2048, "cpu")
    assert (rule.name, rule.source, rule.bucket) == ("bm128_w8r", "rule", "T=4096,K=8,E=128,H=7168,I=2048")
    for name, cfg in FP8_CANDIDATES.items():
        choice = fp8_choice(4096, 8, 128, 7168, 2048, "cpu", name)
        assert cfg.gate_up.block_n == 128 and (choice.name, choice.source) == (name, "explicit")
        # promotion keeps two fp32 copies of the [BM, 2*BN] gate/up tile (rescaled: one): <= 128 registers a thread
        copies = 1 if cfg.gate_up.rescale else 2
        assert copies * cfg.block_m * 2 * cfg.gate_up.block_n // (32 * cfg.gate_up.num_warps) <= 128
        assert 2 * cfg.block_m * cfg.down.block_n // (32 * cfg.down.num_warps) <= 128
    assert fp8_choice(4096, 8, 128, 7168 - 128, 2048, "cpu", "bm64_s4").config.down.block_n == 128  # H % 256 != 0
    with pytest.raises(ValueError, match="'nope' is not a fused_experts_fp8 config \\(one of bm16"):
        fp8_choice(4096, 8, 128, 7168, 2048, "cpu", "nope")


@pytest.mark.parametrize("name", list(FP8_CANDIDATES))
def test_fp8_candidates_within_derived_bound(device, name):
    """Every candidate of the table, by name, within the derived error bound (in the interpreter too)."""
    T, K, G, fmt = 16, 2, 128, "fp32"
    args = _problem(device, T, K, G, fmt, seed=3)
    ws = make_fp8_workspace(T, K, E, H, I, config=name, device=device)
    assert (ws.choice.name, ws.choice.source) == (name, "explicit")
    out = fused_experts_fp8(*args, group_size=G, scale_format=fmt, workspace=ws)
    ref, bound = fp8_reference_with_bound(*args, group_size=G, scale_format=fmt,
                                          model=error_model(torch.device(device), H, I))
    res = check_within_bound("out", out.float(), ref, bound)
    assert res.ok, res.detail


@pytest.mark.parametrize("G,fmt", FORMATS[:2])  # (128, ue8m0) needs H a multiple of 512
def test_fp8_staged_rows_and_descriptors_within_derived_bound(device, G, fmt):
    """Both GEMMs' A tiles through TMA descriptors (gate/up on x's rows staged in sorted order), the tile and K
    loops flattened, gate/up's accumulators rescaled in place, the down loop warp-specialised: the same function,
    within the derived bound."""
    from moebench.kernels._details.experts_config import Fp8ExpertsConfig, Fp8GemmConfig

    cfg = Fp8ExpertsConfig(16, Fp8GemmConfig(128, 4, 4, 1, act_tma=True, flatten=True, rescale=True),
                           Fp8GemmConfig(128, 4, 4, 1, act_tma=True, warp_specialize=True), reduce_block_h=256)
    T, K = 16, 2
    args = _problem(device, T, K, G, fmt, seed=7)
    ws = make_fp8_workspace(T, K, E, H, I, config=cfg, device=device, group_size=G, scale_format=fmt)
    assert ws.x_rows is not None and ws.x_rows.dtype == E4M3
    out = poison(torch.empty(T, H, dtype=torch.bfloat16, device=device))
    fused_experts_fp8(*args, group_size=G, scale_format=fmt, workspace=ws, out=out)
    ref, bound = fp8_reference_with_bound(*args, group_size=G, scale_format=fmt,
                                          model=error_model(torch.device(device), H, I))
    res = check_within_bound("out", out.float(), ref, bound)
    assert res.ok, res.detail


def test_knobs_are_refused_where_they_would_do_nothing():
    from moebench.kernels._details.experts_config import ExpertsConfig, Fp8ExpertsConfig, Fp8GemmConfig, GemmConfig

    with pytest.raises(ValueError, match="fp8 gate/up GEMM only"):
        ExpertsConfig(16, GemmConfig(64, 64, rescale=True), GemmConfig(64, 64))
    with pytest.raises(ValueError, match="fp8 gate/up GEMM only"):
        Fp8ExpertsConfig(16, Fp8GemmConfig(128), Fp8GemmConfig(128, rescale=True))
    assert Fp8ExpertsConfig(16, Fp8GemmConfig(128, rescale=True), Fp8GemmConfig(128)).gate_up.rescale
    with pytest.raises(ValueError, match="bf16 gate/up GEMM only"):
        Fp8ExpertsConfig(16, dataclasses.replace(Fp8GemmConfig(128), one_dot=True), Fp8GemmConfig(128))
    with pytest.raises(ValueError, match="bf16 gate/up GEMM only"):
        ExpertsConfig(16, GemmConfig(64, 64), GemmConfig(64, 64, one_dot=True))


def test_registered_fp8_impls_check(device):
    from moebench.registry import RunContext, get
    from moebench.params import Params

    ctx = RunContext(device=device)
    p = Params(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=256, intermediate=128,
               padding_ratio=0.25, padding_fill="repeat", group_size=32, scale_format="ue8m0_packed")
    for name in ("fused_experts.fp8", "fused_experts.fp8_oblivious"):
        impl = get(name)
        assert impl.available(ctx) is None and impl.validate(p) is None
        case = impl.build(p, ctx)
        res = case.check()
        assert res.ok, (name, res.detail)
        assert case.nvtx_stage == "experts" and case.flops > 0 and case.bytes_moved > 0 and case.roofline_us > 0
        if name.endswith("oblivious"):
            assert case.info["corrupted_rows"] > 0 and case.info["computed_routes"] > case.info["valid_routes"]
        case.cleanup()
    assert get("fused_experts.fp8_oblivious").twin_of == "fused_experts.fp8"
    assert "multiples of 128" in get("fused_experts.fp8").validate(Params(hidden=200))
    assert "group_size 32" in get("fused_experts.fp8").validate(Params(group_size=32, scale_format="fp32"))
    if device.type != "cuda":
        assert "CUDA" in get("fused_experts.fp8_scaled_grouped_mm").available(ctx)


@pytest.mark.gpu
def test_gpu_quantisers_bitwise_at_scale():
    a = torch.cat([_hard_values(40, 2048, seed=s) for s in range(8)]).cuda()
    q, s = requantize_rows_fp8(a)
    q_ref, s_ref = requantize_rows_fp8_torch(a)
    assert torch.equal(_bits(s), _bits(s_ref)) and torch.equal(_bits(q), _bits(q_ref))
    w13, _ = make_expert_weights(4, 7168, 2048, seed=0, device="cuda")
    q, s = quantize_weights_fp8_block(w13)
    q_ref, s_ref = quantize_weights_fp8_block_torch(w13)
    assert torch.equal(_bits(s), _bits(s_ref)) and torch.equal(_bits(q), _bits(q_ref))



def test_128_row_tiles_are_refit_for_group_32_ue8m0_scales(monkeypatch):
    """The table / rule's 128-row gate/up tiles spill under the group-32 ue8m0 layout's per-element alignment: the
    launch for that layout is LAYOUT_FALLBACK, said in the record; other layouts, unknown layouts and explicit
    names launch what was chosen."""
    import moebench.kernels._details.experts_config as mod

    monkeypatch.setattr(mod, "interpreting", lambda: False)
    shape = (256, 4, E, 256, 128)  # 256 routes per expert: the rule's bm128_w8r (small buffers)
    assert fp8_choice(*shape, "cpu").name == "bm128_w8r"
    assert fp8_choice(*shape, "cpu", group_size=128, scale_format="fp32").name == "bm128_w8r"
    v4 = fp8_choice(*shape, "cpu", group_size=32, scale_format="ue8m0_packed")
    assert (v4.name, v4.source, v4.config.block_m, v4.config.gate_up.num_warps) == ("bm64_g16_down128", "rule", 64, 8)
    assert v4.record()["config_note"] == "bm128_w8r refit for ue8m0 group-32 activation scales"
    assert "config_note" not in fp8_choice(*shape, "cpu").record()
    explicit = fp8_choice(*shape, "cpu", "bm128_w16", group_size=32, scale_format="ue8m0_packed")
    assert (explicit.name, explicit.config.block_m) == ("bm128_w16", 128)
    ws = make_fp8_workspace(*shape, device="cpu", group_size=32, scale_format="ue8m0_packed")
    assert (ws.choice.name, ws.config.block_m) == ("bm64_g16_down128", 64)
    # a workspace chosen without the layout still computes, and the call says which launch the layout wants
    args = _problem("cpu", 256, 4, 32, "ue8m0_packed", seed=2, h=256, i=128)
    unfitted = make_fp8_workspace(*shape, device="cpu")
    with pytest.warns(RuntimeWarning, match="launches bm64_g16_down128"):
        fused_experts_fp8(*args, group_size=32, scale_format="ue8m0_packed", workspace=unfitted)

# The default launch under both activation-scale layouts, each candidate under one of them, alternating (only the
# gate/up kernel reads the activation scales: the down kernel compiles once per candidate either way); BM 64 (four
# tilings, TMA and not) meets both layouts, as does the default (at 1024 routes per expert the rule's
# bm128_w8r, where no tuned table has the bucket).
GPU_FP8_FORMATS = [(128, "fp32"), (32, "ue8m0_packed")]
GPU_FP8_CASES = [(None, fmt) for fmt in GPU_FP8_FORMATS] + [
    (name, GPU_FP8_FORMATS[i % 2]) for i, name in enumerate(FP8_CANDIDATES)]


@functools.lru_cache(maxsize=None)
def _gpu_problem(G, fmt):
    """The GPU problem of one scale layout and its reference with the bound, made once for all candidates."""
    h, i = 2048, 512
    args = _problem("cuda", 1024, 4, G, fmt, seed=1, h=h, i=i, pad_rows=256)
    ref, bound = fp8_reference_with_bound(*args, group_size=G, scale_format=fmt,
                                          model=error_model(torch.device("cuda"), h, i))
    return args, ref, bound


@pytest.mark.gpu
@pytest.mark.parametrize("candidate,G,fmt", [(c, G, fmt) for c, (G, fmt) in GPU_FP8_CASES])
def test_gpu_fused_experts_fp8_within_bound(G, fmt, candidate):
    T, K, h, i = 1024, 4, 2048, 512
    args, ref, bound = _gpu_problem(G, fmt)
    ids = args[2]
    ws = make_fp8_workspace(T, K, E, h, i, config=candidate, device="cuda", group_size=G, scale_format=fmt)
    out = fused_experts_fp8(*args, group_size=G, scale_format=fmt, workspace=ws)
    res = check_within_bound("out", out.float(), ref, bound)
    assert res.ok, res.detail
    assert (out[~((ids >= 0) & (ids < E)).any(dim=1)] == 0).all()
