"""peers/deepgemm.py: DeepGEMM's grouped contiguous fp8 GEMM as a peer. On the CPU against the stand-in with its
call signature and layout rules (tests/standins/deep_gemm_standin.py): the compiled contiguous layout, the whole
peer through the registry and the fp8 family's derived bound. On an H200 with deep_gemm built (@gpu): no host sync
and a captured graph right on new routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moebench import registry
from moebench.params import Params
from moebench.peers import deepgemm
from moebench.registry import RunContext
from tests.standins import deep_gemm_standin

CPU = RunContext(device=torch.device("cpu"))
SMALL = dict(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=256, intermediate=128,
             padding_ratio=0.25, padding_fill="repeat", group_size=128, scale_format="fp32")


@pytest.fixture
def standin():
    saved = deepgemm.DEEP_GEMM.lib, deepgemm.DEEP_GEMM.reason
    deepgemm.DEEP_GEMM.bind(deep_gemm_standin)
    yield
    deepgemm.DEEP_GEMM.lib, deepgemm.DEEP_GEMM.reason = saved


def test_contiguous_layout_aligns_each_expert_and_leaves_skipped_routes_out():
    m, k, e, align = 9, 3, 4, 8
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, e + 1, (m, k), generator=g, dtype=torch.int32)
    rows = deepgemm.capacity(m * k, e, align)
    x = torch.arange(m, dtype=torch.float32)[:, None]
    m_indices, position, laid = deepgemm.contiguous_layout(ids, e, align, rows, x)
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    pos = position[valid]
    assert pos.unique().numel() == pos.numel()  # one row per valid route
    assert torch.equal(m_indices[pos].long(), flat[valid])
    assert torch.equal(laid[pos, 0], (torch.arange(m * k) // k)[valid])
    assert int((m_indices >= 0).sum()) == int(valid.sum())
    blocks = m_indices.view(-1, align)
    assert bool(((blocks == blocks[:, :1]) | (blocks == -1)).all())  # one expert (or padding) per aligned block
    experts = [b for b in blocks[:, 0].tolist() if b >= 0]
    assert experts == sorted(experts)


def test_absent_deepgemm_says_why():
    lib = deepgemm.Library("deep_gemm", "moebench_no_such_module", deepgemm._load)
    assert "not installed" in lib.available(CPU, deepgemm.NEEDS)


def test_deepgemm_peer_checks_against_its_standin(standin):
    impl = registry.get("fused_experts.fp8_deepgemm")
    assert impl.library == "deep_gemm" and impl.available(CPU) is None
    p = dataclasses.replace(Params(), **SMALL)
    assert impl.validate(p) is None
    assert "fp32" in impl.validate(dataclasses.replace(p, group_size=32, scale_format="ue8m0_packed"))
    case = impl.build(p, CPU)
    res = case.check()
    assert res.ok, res.detail
    assert case.info["compile_seconds"] > 0 and case.info["deepgemm_align"] == 128
    assert case.info["deepgemm_rows"] == deepgemm.capacity(16 * 3, 4, 128)
    before = deep_gemm_standin.SFA_TRANSPOSES[0]
    case.run()  # a timed call: both GEMMs' activation scales already in DeepGEMM's MN-major TMA-aligned layout
    assert deep_gemm_standin.SFA_TRANSPOSES[0] == before
    assert case.info["deepgemm_sfa_layout"].startswith("MN-major")
    assert case.info["adapter_status"].startswith("stand-in for deep_gemm")


def test_the_standin_transposes_row_major_activation_scales_as_deepgemm_does():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(128, 256, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(2, 128, 256, generator=g).to(torch.float8_e4m3fn)
    sfa, sfb = torch.rand(128, 2, generator=g) + 0.5, torch.rand(2, 1, 2, generator=g) + 0.5
    layout = torch.cat([torch.zeros(64, dtype=torch.int32), torch.full((64,), -1, dtype=torch.int32)])
    d = torch.empty(128, 128, dtype=torch.bfloat16)
    before = deep_gemm_standin.SFA_TRANSPOSES[0]
    deep_gemm_standin.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, layout, disable_ue8m0_cast=True)
    assert deep_gemm_standin.SFA_TRANSPOSES[0] == before + 1  # row-major: transposed inside the call
    deep_gemm_standin.m_grouped_fp8_gemm_nt_contiguous((a, deepgemm.mn_major(sfa)), (b, sfb), d, layout)
    assert deep_gemm_standin.SFA_TRANSPOSES[0] == before + 1 and deepgemm.sfa_is_mn_major(deepgemm.mn_major(sfa))
    assert bool(d[64:].isnan().all()) and bool(d[:64].isfinite().all())  # rows of group -1: undefined


def test_deepgemm_peer_runs_on_sm90_only(monkeypatch):
    """fp32 1x128 / 128x128 scales are DeepGEMM's sm90 recipe; sm100 wants UE8M0 scales moebench's staging is not."""
    saved = deepgemm.DEEP_GEMM.lib, deepgemm.DEEP_GEMM.reason
    deepgemm.DEEP_GEMM.bind(type("real", (), {}))  # a library that is not the stand-in
    try:
        cuda = RunContext(device=torch.device("cuda"))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        assert "sm100" in deepgemm.sm90_only(cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert deepgemm.sm90_only(cuda) is None and deepgemm.sm90_only(CPU) is None
    finally:
        deepgemm.DEEP_GEMM.lib, deepgemm.DEEP_GEMM.reason = saved


@pytest.mark.gpu
def test_gpu_deepgemm_sync_free_and_graph_captured():
    """With deep_gemm built on the H200: the registered peer checks, makes no host sync, and is timed as a graph."""
    from moebench.measure.timing import measure
    from moebench.params import Timing

    ctx = RunContext(device=torch.device("cuda"))
    impl = registry.get("fused_experts.fp8_deepgemm")
    if impl.available(ctx):
        pytest.skip(impl.available(ctx))
    p = dataclasses.replace(Params(), **dict(SMALL, num_tokens=1024, num_experts=128, num_local_experts=128,
                                              top_k=8, hidden=2048, intermediate=1024))
    case = impl.build(p, ctx)
    res = case.check()
    assert res.ok, res.detail
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    timed = measure(case.run, Timing(mode="cuda_graph", warmup=2, iters=5), ctx.device, graph_capturable=True)
    assert timed.mode == "cuda_graph"
