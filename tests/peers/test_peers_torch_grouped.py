"""peers/torch_grouped.py: the torch grouped-GEMM peers. On the CPU: the glue's sorting / offsets / inverse against
a direct computation, the bf16 peer through the registry on torch's own (CPU) _grouped_mm, and the fp8 peer's glue
on the plain-torch loop stand-in of _scaled_grouped_mm (rows past the last group NaN, so a glue that read them
fails its check). On an H200 (@gpu): both peers with no host sync, captured in a CUDA graph, replayed on new
routing and checked against the references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moebench import registry
from moebench.bench.torch_grouped_gemm import LOOP_GEMMS, grouped_mm_loop, scaled_grouped_mm_loop
from moebench.params import Params
from moebench.peers import torch_grouped as tg
from moebench.registry import RunContext

CPU = RunContext(device=torch.device("cpu"))
# local experts 4 of 8: non-local routes are -1 after the expert map, and a quarter of the rows are masked padding
SMALL = dict(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=64, intermediate=32,
             padding_ratio=0.25, padding_fill="repeat")
SMALL_FP8 = dict(SMALL, hidden=256, intermediate=128, group_size=32, scale_format="ue8m0_packed")


def _ids(m, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e + 2, (m, k), generator=g, dtype=torch.int32)  # -1 and ids >= E: skipped
    return ids, g


def test_sort_routes_puts_skipped_routes_past_the_last_group():
    m, k, e = 13, 3, 5
    ids, g = _ids(m, k, e, seed=3)
    x = torch.randn(m, 7, generator=g)
    offs, inv, rows = tg.sort_routes(ids, e, x)
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    counts = torch.stack([(flat == i).sum() for i in range(e)])
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), counts.cumsum(0))
    assert int(offs[-1]) == int(valid.sum())
    order = torch.empty_like(inv).scatter_(0, inv, torch.arange(m * k))  # inv is a permutation
    assert torch.equal(torch.sort(order).values, torch.arange(m * k))
    sorted_key = torch.where(valid, flat, e)[order]
    assert torch.equal(sorted_key, torch.sort(sorted_key).values)  # grouped by expert, skipped last
    assert bool((inv[valid] < offs[-1]).all()) and bool((inv[~valid] >= offs[-1]).all())
    assert torch.equal(rows, x[order // k])


def test_combine_ignores_whatever_lies_past_the_last_group():
    m, k, e, h = 11, 4, 6, 5
    ids, g = _ids(m, k, e, seed=5)
    w = torch.rand(m, k, generator=g)
    offs, inv = tg.sort_routes(ids, e)
    y = torch.randn(m * k, h, generator=g)
    y[int(offs[-1]):] = float("nan")  # what the GEMMs leave there is not defined
    out = tg.combine(y, inv, ids, w, e, torch.full((m, h), float("nan")))
    valid = (ids >= 0) & (ids < e)
    ref = torch.zeros(m, h)
    for t in range(m):
        for s in range(k):
            if valid[t, s]:
                ref[t] += w[t, s] * y[inv[t * k + s]]
    torch.testing.assert_close(out, ref)


def test_loop_standins_define_the_ops_rows_past_offs_as_nan():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(9, 16, generator=g).to(torch.bfloat16), torch.randn(3, 16, 8, generator=g).to(torch.bfloat16)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    out = grouped_mm_loop(a, b, offs=offs)
    ref = torch.cat([a[:2].float() @ b[0].float(), a[2:6].float() @ b[2].float()]).to(torch.bfloat16)
    assert torch.equal(out[:6], ref) and bool(out[6:].isnan().all())
    if hasattr(torch, "_grouped_mm"):  # torch's CPU kernel agrees on the rows it defines
        torch.testing.assert_close(torch._grouped_mm(a, b, offs=offs)[:6].float(), ref.float(), rtol=1e-2, atol=1e-2)
    sa, sb = torch.rand(9, generator=g) + 0.5, torch.rand(3, 8, generator=g) + 0.5
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    out8 = scaled_grouped_mm_loop(a8, b8, sa, sb, offs=offs)
    ref8 = ((a8[2:6].float() * sa[2:6, None]) @ (b8[2].float() * sb[2][None, :])).to(torch.bfloat16)
    assert torch.equal(out8[2:6], ref8) and bool(out8[6:].isnan().all())


def test_bf16_peer_checks_on_torch_cpu_grouped_mm():
    impl = registry.get("fused_experts.grouped_mm")
    assert impl.library == tg.LIBRARY and impl.available(CPU) is None
    p = dataclasses.replace(Params(), **SMALL)
    case = impl.build(p, CPU)
    res = case.check()
    assert res.ok, res.detail
    assert case.graph_capturable and case.info["compile_seconds"] > 0 and case.info["gemms"] == "torch"
    assert case.info["skipped_routes"] > 0  # the point exercises the skipped routes


def test_fp8_peer_glue_checks_on_the_loop_standin():
    impl = registry.get("fused_experts.fp8_scaled_grouped_mm")
    assert impl.library == tg.LIBRARY and "CUDA" in impl.available(CPU)
    p = dataclasses.replace(Params(), **SMALL_FP8)
    assert impl.validate(p) is None
    case = tg.build_scaled_grouped_mm(LOOP_GEMMS)(p, CPU)
    res = case.check()
    assert res.ok, res.detail
    assert case.info["compile_seconds"] > 0 and case.info["gemms"] == LOOP_GEMMS.name


@pytest.mark.gpu
def test_gpu_peers_sync_free_graph_captured_and_right_on_new_routing():
    """Both peers at 64 experts, T=512, top-8, H=1024, I=512 with -1 routes: a call makes no host sync
    (torch.cuda.set_sync_debug_mode("error")), a captured graph replayed after the routing is rewritten in place
    matches the references of the new routing."""
    from moebench.bench.experts import check_experts_out
    from moebench.bench.experts_fp8 import check_within_bound
    from moebench.check import poison
    from moebench.inputs.weights import make_expert_weights
    from moebench.kernels.fp8_quant import quantize_weights_fp8_block, requantize_per_row, rowwise_weights
    from moebench.kernels.fused_experts_fp8_ref import BF16_REL, error_model, reference_from_dequantised

    dev = torch.device("cuda")
    m, k, e, h, i = 512, 8, 64, 1024, 512
    g = torch.Generator(device=dev).manual_seed(0)

    def routing():
        ids = torch.rand(m, e, generator=g, device=dev).topk(k, dim=1).indices.to(torch.int32)
        ids = torch.where(torch.rand(m, k, generator=g, device=dev) < 0.3, -1, ids).to(torch.int32)
        return ids, torch.softmax(torch.randn(m, k, generator=g, device=dev), dim=1)

    x = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    w13, w2 = make_expert_weights(e, h, i, seed=0, device=dev)
    ids, w = routing()
    out = torch.empty(m, h, dtype=torch.bfloat16, device=dev)
    (x_q, x_s), (w13_q, w13_s), (w2_q, w2_s) = (requantize_per_row(x.float()),
                                                rowwise_weights(*quantize_weights_fp8_block(w13)),
                                                rowwise_weights(*quantize_weights_fp8_block(w2)))
    bf16 = tg.GroupedMmExperts()
    calls = {"bf16": lambda: bf16(x, w13, w2, w, ids, out=out)}
    fp8 = tg.ScaledGroupedMmExperts(x_q, x_s, w13_q, w13_s, w2_q, w2_s)
    calls["fp8"] = lambda: fp8(ids, w, out=out)

    def check(name):
        if name == "bf16":
            return check_experts_out(out, x, w13, w2, w, ids, seed=0)
        ref, bound = reference_from_dequantised(
            x_q.float() * x_s[:, None], lambda j: w13_q[j].float() * w13_s[j][:, None],
            lambda j: w2_q[j].float() * w2_s[j][:, None], ids, w, e, act_group=i,
            model=error_model(dev, h, i, h_store_rel=BF16_REL))
        return check_within_bound("out", out.float(), ref, bound)

    for name, call in calls.items():
        call()  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call()
        new_ids, new_w = routing()
        ids.copy_(new_ids)
        w.copy_(new_w)
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        res = check(name)
        assert res.ok, (name, res.detail)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fused_experts.grouped_mm", "fused_experts.fp8_scaled_grouped_mm",
                                  "fused_experts.ceiling", "fused_experts.ceiling_equal",
                                  "fused_experts.fp8_ceiling", "fused_experts.fp8_ceiling_equal"])
def test_gpu_registered_peers_and_ceilings_check_and_time_as_graph_replays(name):
    """Through the registry as a sweep runs them (128 experts, T=1024, top-8, H=2048, I=1024, a quarter padded):
    checked, then timed by measure() as CUDA-graph replays (no fallback to events)."""
    from moebench.measure.timing import measure
    from moebench.params import Timing

    ctx = RunContext(device=torch.device("cuda"))
    p = dataclasses.replace(Params(), num_tokens=1024, num_experts=128, top_k=8, hidden=2048, intermediate=1024,
                            padding_ratio=0.25, padding_fill="repeat", group_size=128, scale_format="fp32")
    impl = registry.get(name)
    assert impl.available(ctx) is None and impl.validate(p) is None
    case = impl.build(p, ctx)
    res = case.check()
    assert res.ok, res.detail
    timed = measure(case.run, Timing(mode="cuda_graph", warmup=2, iters=5), ctx.device,
                    graph_capturable=case.graph_capturable)
    assert timed.mode == "cuda_graph" and timed.stats["p50"] > 0, timed.note
