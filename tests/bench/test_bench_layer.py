"""The single-GPU MoE layer (moebench/bench/layer.py): masked vs oblivious pipelines against fp32 references, padded
rows, stage-by-stage execution, the runner's per-stage records.

CPU runs go through Triton's interpreter: T=16, E=8, K=2, H=128, I=32, group 32."""

import pytest
import torch

from moebench.bench import layer as layer_mod
from moebench.inputs import cached_expert_weights, make_batch, route
from moebench.kernels.apply_expert_map import apply_expert_map_torch, build_expert_map
from moebench.kernels.fused_experts import fused_experts_torch
from moebench.params import Params
from moebench.registry import get
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import sweep_from_dict

from tests.layer_helpers import (assert_layers_replay_and_agree, assert_oblivious_computes_padded_rows,
                                 build_case as _build, frob as _frob)

SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=128, intermediate=32, group_size=32, dtype="fp32")


def _params(**kw) -> Params:
    return Params(**{**SMALL, "padding_ratio": 0.5, "padding_fill": "repeat", **kw})


def _fp32_layer(p: Params, device, *, masked: bool) -> torch.Tensor:
    """An independent fp32 reference of the whole layer: reference router -> rank 0's local ids -> fp32 experts
    -> weighted sum (fused_experts_torch)."""
    batch = make_batch(p, device)
    weights, ids = route(p, batch, use_mask=masked)
    w13, w2 = cached_expert_weights(p.local_experts, p.hidden, p.intermediate, p.seed, torch.device(device))
    return fused_experts_torch(batch.hidden, w13, w2, weights, _rank0_local_ids(ids, p),
                               out_dtype=torch.float32)


def _rank0_local_ids(ids: torch.Tensor, p: Params) -> torch.Tensor:
    """EP rank 0's local ids: g -> g for g < p.local_experts, every other id -> -1."""
    expert_map = build_expert_map(p.num_experts, local_experts=p.local_experts, device=ids.device)
    return apply_expert_map_torch(ids, expert_map).to(torch.int32)


def _out(case) -> torch.Tensor:
    return case.run()


def test_masked_layer_matches_fp32_reference(device):
    p = _params()
    case = _build("layer.masked", p, device)
    res = case.check()
    assert res.ok, res.detail
    out = _out(case)
    batch = make_batch(p, device)
    real = ~batch.is_padding
    assert batch.is_padding.sum() == 8
    ref = _fp32_layer(p, device, masked=True)
    assert torch.isfinite(out).all()
    assert _frob(out[real].float(), ref[real]) < 1e-2
    # padded rows: exactly zero, bit for bit (+0.0)
    assert (out[batch.is_padding].view(torch.int16) == 0).all()
    assert case.info["misrouted_routes"] == 0 and case.info["corrupted_rows"] == 0
    assert case.info["valid_routes"] == int(real.sum()) * p.top_k  # all experts local: every real route computed
    assert case.nvtx_stage == "layer" and [n for n, _ in case.stages] == list(layer_mod.STAGES)


def test_oblivious_layer_computes_padded_rows(device):
    p = _params()
    masked, oblivious = _build("layer.masked", p, device), _build("layer.oblivious", p, device)
    res = oblivious.check()
    assert res.ok, res.detail  # against its own unmasked reference
    assert masked.check().ok
    out_o, out_m = _out(oblivious).clone(), _out(masked).clone()
    batch = make_batch(p, device)
    pad = batch.is_padding
    # padded rows computed as real: the unmasked fp32 reference, non-zero output
    ref = _fp32_layer(p, device, masked=False)
    assert _frob(out_o.float(), ref) < 1e-2
    # real rows as the masked layer's, within rows_differing (the interpreter's fp32 -> bf16 cast truncates too)
    assert_oblivious_computes_padded_rows(p, masked, oblivious, out_m, out_o, pad)
    info = oblivious.info
    # repeat fill: every padded row routes like the first real row, onto the same top_k experts
    ids = oblivious.routing.topk_ids
    assert (ids[pad] == ids[0]).all()
    # the extra work declared is the padded rows' routes
    assert info["processed_routes"] - masked.info["processed_routes"] == info["misrouted_routes"]


def test_stages_one_by_one_equal_run(device):
    p = _params(padding_fill="random", num_local_experts=4)
    for impl in ("layer.masked", "layer.oblivious"):
        case = _build(impl, p, device)
        whole = case.run().clone()
        case.run.__self__.poison_all()  # every buffer of the pipeline
        for _, fn in case.stages:  # then each stage alone, in order, on what the previous one left
            fn()
        again = case.run()
        assert torch.equal(whole.view(torch.int16), again.view(torch.int16)), impl
        # re-running a stage alone does not change anything downstream of it
        before = again.clone()
        dict(case.stages)["align"]()
        dict(case.stages)["experts"]()
        dict(case.stages)["reduce"]()
        assert torch.equal(before.view(torch.int16), case.run().view(torch.int16))


def test_non_local_experts_skipped_by_both(device):
    # rank 0 owns experts 0..3 of 8; the repeat-filled padded rows copy row 0, whose experts may or may not be
    # local: whatever they are, real rows agree between the layers and only padded rows can differ
    p = _params(num_local_experts=4, padding_fill="random", seed=3)
    masked, oblivious = _build("layer.masked", p, device), _build("layer.oblivious", p, device)
    assert masked.check().ok
    res = oblivious.check()
    assert res.ok, res.detail
    assert oblivious.info["reduce"] == "masked_moe_sum"  # plain sum would add never-computed non-local rows
    pad = make_batch(p, device).is_padding
    out_m, out_o = _out(masked).clone(), _out(oblivious).clone()
    assert torch.equal(out_m[~pad], out_o[~pad])
    ref = _fp32_layer(p, device, masked=True)
    assert _frob(out_m[~pad].float(), ref[~pad]) < 1e-2
    # random padded rows route to many experts, some of them local
    assert oblivious.info["misrouted_routes"] > 0
    assert oblivious.info["corrupted_rows"] == oblivious.info["corrupted_padded_rows"] > 0


def test_grouped_router_layer(device):
    p = _params(num_expert_group=4, topk_group=2, scoring="sigmoid", bias=True, routed_scaling_factor=2.5)
    for impl in ("layer.masked", "layer.oblivious"):
        case = _build(impl, p, device)
        assert case.info["router"] == "grouped_topk"
        res = case.check()
        assert res.ok, (impl, res.detail)
    ref = _fp32_layer(p, device, masked=True)
    pad = make_batch(p, device).is_padding
    out = _out(_build("layer.masked", p, device))
    assert _frob(out[~pad].float(), ref[~pad]) < 1e-2


def test_no_padding_layers_agree(device):
    p = _params(padding_ratio=0.0)
    masked, oblivious = _build("layer.masked", p, device), _build("layer.oblivious", p, device)
    assert masked.check().ok and oblivious.check().ok
    assert not layer_mod.rows_differing(_out(oblivious), _out(masked)).any()
    assert oblivious.info["corrupted_rows"] == 0 and oblivious.info["misrouted_routes"] == 0
    assert masked.flops == oblivious.flops


def test_check_catches_a_broken_stage(device, monkeypatch):
    p = _params()
    case = _build("layer.masked", p, device)
    monkeypatch.setattr(layer_mod, "down_proj", lambda *a, **k: None)  # y never written: poison reaches out
    res = case.check()
    assert not res.ok and "out" in res.detail
    monkeypatch.undo()
    # an expert map that turns -1 into expert 0: padded rows computed (ids stay in range, so nothing faults).
    # Their staged weights are 0.0, so the output stays right: the stage checks are what catch the wasted work.
    monkeypatch.setattr(layer_mod, "apply_expert_map", lambda ids, m, out: out.copy_(ids.clamp(min=0)))
    res = case.check()
    assert not res.ok and "local_ids" in res.detail and "num_tokens_post_padded" in res.detail
    assert case.info["misrouted_routes"] == 8 * p.top_k
    monkeypatch.undo()
    case = _build("layer.oblivious", p, device)
    monkeypatch.setattr(layer_mod, "moe_sum_oblivious", lambda *a, **k: None)  # out left poisoned
    assert not case.check().ok


def test_work_accounting(device):
    p = _params()
    case = _build("layer.masked", p, device)
    info = case.info
    H, I = p.hidden, p.intermediate
    assert case.flops == 2 * info["processed_routes"] * 3 * H * I
    assert set(info["stage_roofline_us"]) == set(layer_mod.STAGES)
    assert case.bytes_moved == sum(info["stage_bytes"].values())
    # the experts stage reads each hit expert's weights once
    assert info["stage_bytes"]["experts"] >= info["experts_hit"] * 3 * H * I * 2


def test_validation():
    v = get("layer.masked").validate
    assert v(_params()) is None
    assert "hidden" in v(_params(hidden=192))  # not a multiple of 4*32
    assert "top_k" in v(_params(num_experts=64, top_k=33))
    assert v(_params(num_expert_group=3)) is not None  # 3 groups do not divide 8 experts


def test_layer_point_through_runner(tmp_path):
    # 8 tokens (4 padded): through the runner each point runs the layer four times or more in the interpreter
    raw = {"name": "layer_t", "target": "layer", "impls": ["layer.masked", "layer.oblivious"],
           "fixed": {**SMALL, "num_tokens": 8, "padding_fill": "repeat", "padding_ratio": 0.5},
           "timing": {"mode": "auto", "warmup": 0, "iters": 1}}
    sweep = sweep_from_dict(raw)
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu")
    recs = {r["impl"]: r for r in load_records(run_dir)}
    assert code == 0, [(r["status"], r.get("reason")) for r in recs.values()]
    for impl, rec in recs.items():
        assert rec["status"] == "ok" and rec["check"]["ok"]
        assert set(rec["stages"]) == set(layer_mod.STAGES)
        assert all(rec["stages"][s]["n"] == 1 for s in layer_mod.STAGES)
        assert rec["flops"] > 0 and rec["bytes"] > 0
        assert "imbalance" in rec
    assert recs["layer.oblivious"]["info"]["corrupted_rows"] > 0
    assert recs["layer.masked"]["info"]["corrupted_rows"] == 0


@pytest.mark.gpu
def test_deepseek_v3_shape_gpu():
    """DeepSeek-V3-like layer on one H200: 256 experts all local, top-8, H=7168, I=2048, 4096 tokens, half padding."""
    p = Params(num_tokens=4096, num_experts=256, top_k=8, hidden=7168, intermediate=2048, padding_ratio=0.5,
               padding_fill="repeat", num_expert_group=8, topk_group=4, scoring="sigmoid", bias=True,
               routed_scaling_factor=2.5)
    assert_layers_replay_and_agree(p, max_frobenius_rel=1e-2)
