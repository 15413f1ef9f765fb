"""peers/vllm_experts.py: vLLM's fused_experts peers (bf16 and fp8 w8a8 block [128, 128]) against the vLLM stand-in
(tests/standins/vllm_ops.py): skipped routes through an expert_map entry of -1, the launch config vLLM picks (its
tuned file or default rule) in the record, the fp8 call of both API generations. Their reference checks at the small
points run in tests/peers/test_peers.py (adapter_points)."""

from __future__ import annotations


import pytest

from moebench import registry
from moebench.families import get_family
from moebench.peers import vllm as peers_vllm
from tests.peers.peer_checks import CPU, bound, checked as _check, params as _params
from tests.standins import vllm_ops

SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=64, intermediate=32, padding_ratio=0.25)
FP8 = dict(SMALL, num_local_experts=4, top_k=3, hidden=256, intermediate=128, group_size=128, scale_format="fp32")
POINTS = {"fused_experts.vllm": SMALL, "fused_experts.fp8_vllm": FP8}


@pytest.fixture(name="standins")
def bound_vllm():
    with bound(peers_vllm.VLLM, vllm_ops):
        yield




def test_vllm_fused_experts_hands_skipped_routes_through_its_expert_map(standins):
    case, res = _check("fused_experts.vllm", _params(**SMALL))
    assert res.ok, res.detail
    assert "expert_map" in case.info["vllm_skipped_routes"] and case.info["skipped_routes"] > 0
    assert case.info["adapter_status"].startswith("stand-in for vllm")

    def hands_minus_one(x, w13, w2, topk_weights, topk_ids, *, out=None):  # the pre-fix adapter
        return vllm_ops.fused_experts(x, w13, w2, topk_weights, topk_ids, global_num_experts=w13.shape[0])

    case = get_family("fused_experts").build_for(hands_minus_one)(_params(**SMALL), CPU)
    with pytest.raises(IndexError, match="negative"):  # vLLM's alignment would read before its buffers
        case.check()


def test_a_vllm_fused_experts_without_expert_map_refuses_skipped_routes(standins):
    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu"):
        return vllm_ops.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids)

    peers_vllm.VLLM.bind(type("v", (), {"fused_experts": staticmethod(fused_experts), "MOEBENCH_STANDIN": True}))
    impl = registry.get("fused_experts.vllm")
    with pytest.raises(ValueError, match="no expert_map"):
        impl.build(_params(**SMALL), CPU).check()
    case, res = _check("fused_experts.vllm", _params(**dict(SMALL, padding_ratio=0.0)))  # no skipped route
    assert res.ok and case.info["skipped_routes"] == 0 and "no expert_map" in case.info["vllm_skipped_routes"]


@pytest.mark.parametrize("name, dtype_part", [("fused_experts.vllm", ""),
                                              ("fused_experts.fp8_vllm", ",dtype=fp8_w8a8,block_shape=[128,128]")])
def test_vllm_experts_record_the_launch_config_vllm_picks(standins, monkeypatch, name, dtype_part):
    point = POINTS[name]
    E, N = point.get("num_local_experts", point["num_experts"]), point["intermediate"]
    file = f"E={E},N={N},device_name=stand-in_CPU{dtype_part}.json"
    case, res = _check(name, _params(**point))
    assert res.ok, res.detail
    assert case.info["vllm_config_file"] == file and "default rule" in case.info["vllm_config_source"]
    assert case.info["vllm_config"] == vllm_ops.LAST_CONFIG[0]  # what fused_experts ran with
    tuned = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4}
    monkeypatch.setitem(vllm_ops.TUNED_CONFIGS, file, {1: dict(tuned, num_stages=2), 16: tuned, 4096: {}})
    case, res = _check(name, _params(**point))
    assert res.ok, res.detail
    assert case.info["vllm_config_source"] == f"vLLM's tuned file {file}"
    assert case.info["vllm_config"] == tuned == vllm_ops.LAST_CONFIG[0]  # the batch size closest to T = 16


def test_vllm_config_is_looked_up_for_the_rows_of_one_chunk(monkeypatch):
    from types import SimpleNamespace

    from moebench.peers.vllm_experts import picked_config

    file = vllm_ops.get_config_file_name(4, 32, None)
    monkeypatch.setitem(vllm_ops.TUNED_CONFIGS, file, {8: {"BLOCK_SIZE_M": 16}, 64: {"BLOCK_SIZE_M": 64}})
    names = ("try_get_optimal_moe_config", "get_config_file_name", "get_moe_configs")
    lib = SimpleNamespace(**{n: getattr(vllm_ops, n) for n in names})
    assert picked_config(lib, (4, 64, 64), (4, 64, 32), 2, None, 64)["vllm_config"] == {"BLOCK_SIZE_M": 64}
    lib.VLLM_FUSED_MOE_CHUNK_SIZE = 8  # fused_experts runs 64 tokens as chunks of 8, each looked up at M = 8
    assert picked_config(lib, (4, 64, 64), (4, 64, 32), 2, None, 64)["vllm_config"] == {"BLOCK_SIZE_M": 16}


def test_vllm_fp8_experts_take_a_quant_config_where_the_version_does(standins):
    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                      global_num_experts=-1, expert_map=None, quant_config=None):
        return vllm_ops.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts=
                                      global_num_experts, expert_map=expert_map, use_fp8_w8a8=True, **quant_config)

    def fp8_w8a8_moe_quant_config(w1_scale, w2_scale, a1_scale=None, a2_scale=None, block_shape=None):
        return {"w1_scale": w1_scale, "w2_scale": w2_scale, "block_shape": block_shape}

    lib = type("v", (), {"fused_experts": staticmethod(fused_experts), "MOEBENCH_STANDIN": True,
                         "fp8_w8a8_moe_quant_config": staticmethod(fp8_w8a8_moe_quant_config)})
    peers_vllm.VLLM.bind(lib)
    case, res = _check("fused_experts.fp8_vllm", _params(**FP8))
    assert res.ok, res.detail
    assert case.info["vllm_fp8_api"] == "quant_config" and case.info["vllm_config_source"].startswith("unknown")
