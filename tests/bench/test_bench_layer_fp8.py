"""The single-GPU MoE layer with expert_dtype fp8 (moebench/bench/layer.py + bench/_layer_fp8.py): the experts
stage runs the fp8 grouped GEMMs on the staged rows, masked and oblivious alike, checked against the dequantised
reference within its derived bound; fp8 bytes and roof for the experts stage; bf16 points unchanged.

CPU runs go through Triton's interpreter: T=16, E=8, K=2, H=128, I=128 (fp8 needs 128x128 weight blocks)."""

import pytest
import torch

from moebench.bench import _layer_fp8
from moebench.bench import layer as layer_mod
from moebench.bench.experts_fp8 import quantized_expert_weights
from moebench.check import poison
from moebench.inputs import make_batch, route
from moebench.kernels.apply_expert_map import apply_expert_map_torch, build_expert_map
from moebench.kernels.fused_experts_fp8_ref import fused_experts_fp8_torch
from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs_torch
from moebench.measure.roofline import roofline_us
from moebench.params import Params
from moebench.registry import get
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import expand, sweep_from_dict

from tests.layer_helpers import (assert_layers_replay_and_agree, assert_oblivious_computes_padded_rows,
                                 build_case as _build, frob as _frob)

SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=128, intermediate=128, group_size=32, dtype="fp32")


def _params(**kw) -> Params:
    return Params(**{**SMALL, "padding_ratio": 0.5, "padding_fill": "repeat", "expert_dtype": "fp8", **kw})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _fp8_layer_reference(p: Params, device, case, *, masked: bool) -> torch.Tensor:
    """An independent fp32 reference of the fp8 layer: reference router -> torch staging -> rank 0's local ids ->
    the dequantised fp8 experts (fused_experts_fp8_torch). The fp8 rows are the layer's own staged ones: they
    equal the torch staging's bit for bit on a GPU, but the interpreter's fp32 -> e4m3 cast loses carries (124.4
    -> 64), which the staging check tolerates and which would move the output by far more than the fp8 GEMMs do."""
    batch = make_batch(p, device)
    weights, ids = route(p, batch, use_mask=masked)
    x_q, x_sf, staged_ids, staged_w = prepare_moe_inputs_torch(batch.hidden, weights.float(), ids,
                                                               batch.is_padding if masked else None,
                                                               p.group_size, p.scale_format)
    pipe = case.run.__self__
    if device.type == "cuda":
        assert torch.equal(x_q.view(torch.uint8), pipe.staged[0].view(torch.uint8))
    assert torch.equal(x_sf, pipe.staged[1])
    expert_map = build_expert_map(p.num_experts, local_experts=p.local_experts, device=ids.device)
    local = apply_expert_map_torch(staged_ids, expert_map)
    w = quantized_expert_weights(p.local_experts, p.hidden, p.intermediate, seed=p.seed, device=torch.device(device))
    return fused_experts_fp8_torch(pipe.staged[0], x_sf, local, staged_w, *w, group_size=p.group_size,
                                   scale_format=p.scale_format, out_dtype=torch.float32)


def test_masked_fp8_layer(device):
    p = _params()
    case = _build("layer.masked", p, device)
    res = case.check()
    assert res.ok, res.detail
    assert "out.bound_ratio" in res.metrics and res.metrics["out.rows_checked"] == 8
    out = case.run()
    pad = make_batch(p, device).is_padding
    assert torch.isfinite(out).all()
    assert (_bits(out[pad]) == 0).all()  # padded rows: exactly +0.0
    ref = _fp8_layer_reference(p, device, case, masked=True)
    assert _frob(out[~pad].float(), ref[~pad]) < 1e-2
    assert case.info["misrouted_routes"] == 0 and case.info["corrupted_rows"] == 0
    assert case.info["valid_routes"] == int((~pad).sum()) * p.top_k
    pipe = case.run.__self__
    assert pipe.fp8 is not None and pipe.block_m == pipe.fp8.block_m and pipe.y is pipe.fp8.y
    assert case.info["config"] == pipe.fp8.config.short()


def test_oblivious_fp8_layer_computes_padded_rows(device):
    p = _params()
    masked, oblivious = _build("layer.masked", p, device), _build("layer.oblivious", p, device)
    res = oblivious.check()
    assert res.ok, res.detail  # against its own unmasked reference
    out_o, out_m = oblivious.run().clone(), masked.run().clone()
    pad = make_batch(p, device).is_padding
    ref = _fp8_layer_reference(p, device, oblivious, masked=False)
    assert _frob(out_o.float(), ref) < 1e-2
    assert_oblivious_computes_padded_rows(p, masked, oblivious, out_m, out_o, pad)


def test_fp8_non_local_experts_skipped_by_both(device):
    p = _params(num_local_experts=4, padding_fill="random", seed=3)
    masked, oblivious = _build("layer.masked", p, device), _build("layer.oblivious", p, device)
    for case in (masked, oblivious):
        res = case.check()
        assert res.ok, res.detail
    assert oblivious.info["reduce"] == "masked_moe_sum"
    pad = make_batch(p, device).is_padding
    assert torch.equal(_bits(masked.run()[~pad]), _bits(oblivious.run()[~pad]))
    assert oblivious.info["corrupted_rows"] == oblivious.info["corrupted_padded_rows"] > 0


def _run_with_hidden_poisoned_after_staging(case) -> torch.Tensor:
    """Every stage in order, the bf16 hidden states overwritten with NaN between the staging and the experts."""
    pipe = case.run.__self__
    hidden = pipe.batch.hidden.clone()
    stages = dict(case.stages)
    try:
        pipe.poison_all()
        stages["route"]()
        stages["stage"]()
        poison(pipe.batch.hidden)
        for name in ("expert_map", "align", "experts", "reduce"):
            stages[name]()
        return pipe.out.clone()
    finally:
        pipe.batch.hidden.copy_(hidden)


@pytest.mark.parametrize("impl", ["layer.masked", "layer.oblivious"])
def test_fp8_experts_consume_the_staged_rows(device, impl, monkeypatch):
    p = _params()
    case = _build(impl, p, device)
    whole = case.run().clone()
    assert torch.equal(_bits(_run_with_hidden_poisoned_after_staging(case)), _bits(whole))
    # the bf16 experts read the hidden states, so the same poisoning reaches their output
    bf16 = _build(impl, _params(expert_dtype="bf16"), device)
    assert not torch.isfinite(_run_with_hidden_poisoned_after_staging(bf16)).all()
    # and the fp8 GEMMs are handed the staging's own buffers and the layer's alignment
    seen = []
    real = _layer_fp8.fp8_expert_gemms
    monkeypatch.setattr(_layer_fp8, "fp8_expert_gemms", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    pipe = case.run.__self__
    case.run()
    (args, kwargs), = seen
    x_q, x_sf, topk_w = args[0], args[1], args[2]
    assert x_q is pipe.staged[0] and x_sf is pipe.staged[1] and topk_w is pipe.staged[3]
    assert all(a is b for a, b in zip(args[8], pipe.align_out))


def test_fp8_stages_one_by_one_equal_run(device):
    p = _params(padding_fill="random", num_local_experts=4)
    for impl in ("layer.masked", "layer.oblivious"):
        case = _build(impl, p, device)
        whole = case.run().clone()
        case.run.__self__.poison_all()  # the fp8 workspace's act / scales / y included
        for _, fn in case.stages:
            fn()
        assert torch.equal(_bits(whole), _bits(case.run())), impl


def test_fp8_check_catches_unwritten_experts(device, monkeypatch):
    case = _build("layer.masked", _params(), device)
    monkeypatch.setattr(_layer_fp8, "fp8_expert_gemms", lambda *a, **k: None)  # y never written
    res = case.check()
    assert not res.ok and "out" in res.detail


def test_fp8_work_accounting(device):
    p = _params()
    fp8, bf16 = _build("layer.masked", p, device), _build("layer.masked", _params(expert_dtype="bf16"), device)
    info, info16 = fp8.info, bf16.info
    H, I = p.hidden, p.intermediate
    assert fp8.flops == bf16.flops == 2 * info["processed_routes"] * 3 * H * I
    assert fp8.bytes_moved == sum(info["stage_bytes"].values())
    n, hit, rows = info["processed_routes"], info["experts_hit"], info["rows_with_routes"]
    x_sf = fp8.run.__self__.staged[1]
    weights = hit * (3 * H * I + 3 * (H // 128) * (I // 128) * 4)
    staged_rows = rows * (H + x_sf.shape[1] * x_sf.element_size())
    act_y = n * ((I + I // 128 * 4) * 2 + H * 2)
    assert info["stage_bytes"]["experts"] == weights + staged_rows + act_y + n * (4 + 4)
    assert info["stage_bytes"]["experts"] < info16["stage_bytes"]["experts"]
    for stage in ("route", "stage", "expert_map", "align", "reduce"):
        assert info["stage_bytes"][stage] == info16["stage_bytes"][stage], stage
    assert info["stage_roofline_us"]["experts"] == pytest.approx(
        roofline_us(fp8.flops, info["stage_bytes"]["experts"], fp8=True))


def test_fp8_validation():
    v = get("layer.masked").validate
    assert v(_params()) is None
    assert v(_params(intermediate=32, expert_dtype="bf16")) is None
    why = v(_params(intermediate=32))
    assert why.startswith("expert_dtype fp8") and "intermediate" in why
    assert "group_size" in v(_params(group_size=64, hidden=256))  # ue8m0 groups of 64: no fp8 kernel layout
    assert v(_params(group_size=128, hidden=512, scale_format="fp32")) is None


def test_expert_dtype_param():
    assert Params().expert_dtype == "bf16"
    base = {"name": "k", "target": "layer", "impls": ["layer.masked"], "fixed": dict(SMALL)}
    key = expand(sweep_from_dict(base))[0].key
    at_default = expand(sweep_from_dict({**base, "fixed": {**SMALL, "expert_dtype": "bf16"}}))[0].key
    fp8 = expand(sweep_from_dict({**base, "fixed": {**SMALL, "expert_dtype": "fp8"}}))[0].key
    assert key == at_default != fp8  # existing runs' keys do not change at the default
    with pytest.raises(ValueError, match="expert_dtype"):
        sweep_from_dict({**base, "fixed": {**SMALL, "expert_dtype": "fp4"}})


def test_fp8_layer_points_through_runner(tmp_path):
    # 8 tokens (4 padded): through the runner each point runs the layer four times or more in the interpreter. The
    # fp8 points only: the same two impls at bf16 go through the runner in test_bench_layer.py (same shape)
    raw = {"name": "layer_fp8_t", "target": "layer", "impls": ["layer.masked", "layer.oblivious"],
           "fixed": {**SMALL, "num_tokens": 8, "padding_fill": "repeat", "padding_ratio": 0.5},
           "axes": {"expert_dtype": ["fp8"]},
           "timing": {"mode": "auto", "warmup": 0, "iters": 1}}
    code, run_dir = run_sweep(sweep_from_dict(raw), out_base=tmp_path / "results", device="cpu")
    recs = load_records(run_dir)
    assert code == 0, [(r["status"], r.get("reason")) for r in recs]
    assert len(recs) == 2
    for rec in recs:
        assert rec["status"] == "ok" and rec["check"]["ok"], rec.get("check")
        assert set(rec["stages"]) == set(layer_mod.STAGES)
        assert rec["params"]["expert_dtype"] == "fp8"
    by = {r["impl"]: r for r in recs}
    assert by["layer.oblivious"]["info"]["corrupted_rows"] > 0
    assert by["layer.masked"]["info"]["corrupted_rows"] == 0


@pytest.mark.gpu
def test_deepseek_v3_shape_fp8_gpu():
    """DeepSeek-V3-like layer with fp8 experts on one H200: 256 experts all local, top-8, H=7168, I=2048, 4096
    tokens, half padding; checked, replayed from CUDA graphs, masked and oblivious agreeing on real rows."""
    p = Params(num_tokens=4096, num_experts=256, top_k=8, hidden=7168, intermediate=2048, padding_ratio=0.5,
               padding_fill="repeat", num_expert_group=8, topk_group=4, scoring="sigmoid", bias=True,
               routed_scaling_factor=2.5, expert_dtype="fp8")
    assert_layers_replay_and_agree(p)
