"""Dispatch paths (agrs, a2a, a2a_fixed) on spawned gloo ranks against the single-process reference; the
fixed-capacity pack/combine Triton kernels (interpreter) against their torch references; capacity policies;
the registered dispatch impls end to end; DeepEP detection. GPU (2 GPUs): NCCL paths and a2a_fixed in a CUDA graph.
"""

import os

import pytest
import torch

from moebench import dist as mdist
from moebench.check import compare_close, compare_exact, poison
from moebench.dispatch.a2a import A2APath, destination_order
from moebench.dispatch.a2a_fixed import (A2AFixedPath, combine_fixed, combine_fixed_torch, pack_fixed,
                                         pack_fixed_torch, send_positions)
from moebench.dispatch.agrs import AGRSPath
from moebench.dispatch.base import (EPLayout, capacity_for, check_received, count_padding_received,
                                    effective_ids, gather_inputs, max_rows_per_pair, scaled_expert,
                                    scaled_expert_reference, token_in_rank)

T, H, K, E = 12, 32, 3, 8  # K = 3: the Triton kernels pad the slot axis to a power of two
NUM_PADDING = 4
# one wire row: 64 B of bf16 hidden row, then 7 int32 of routing at a 32-byte boundary, padded to 32 bytes
WIRE_ROW = 96


# ---------------------------------------------------------------------------------------------------------------
# Inputs and one path round trip (used in the spawned ranks and in-process)
# ---------------------------------------------------------------------------------------------------------------

def make_inputs(rank: int, device="cpu", seed=0):
    """One rank's rows: random hidden rows, K distinct experts per row with a few -1 slots, the trailing rows
    padding. Padded rows are identical and keep live ids (as an oblivious router gives them), so a mask-aware
    path must drop them because of is_padding alone."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, K, generator=g) < 0.15] = -1
    w = torch.rand(T, K, generator=g) + 0.05
    is_padding = torch.zeros(T, dtype=torch.bool)
    is_padding[T - NUM_PADDING:] = True
    x[is_padding] = x[0].clone()
    ids[is_padding] = torch.tensor([0, E - 1, 1], dtype=torch.int32)[:K]  # hot experts on first and last rank
    w[is_padding] = w[0].clone()
    return x.to(device), ids.to(device), w.to(device), is_padding.to(device)


def round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=None):
    """Dispatch + expert + combine, then every check; returns a plain dict (picklable)."""
    mask = is_padding if masked else None
    if garbage_seed is not None:
        path.fill_garbage(torch.Generator(device=x.device).manual_seed(garbage_seed))
        path.reset_overflow()
    out = poison(torch.empty_like(x))
    d = path.dispatch(x, ids, w, mask)
    y = scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)
    path.combine(y, d.handle, out=out)
    g = gather_inputs(x, ids, w, is_padding, masked, layout)
    recv = check_received(path, d, g)
    ref = scaled_expert_reference(x, effective_ids(ids, mask), w, layout.experts_per_rank)
    comb = compare_close("combined", out, ref, 2e-2, 5e-3)
    res = {"recv_ok": recv.ok, "recv_detail": recv.detail, "combined_ok": comb.ok, "combined_detail": comb.detail,
           **count_padding_received(path, d, g), "stats": path.stats(d).as_info()}
    if isinstance(path, A2AFixedPath):
        res["invalid_rows_clean"] = path.invalid_rows_clean()
        res["overflow"] = path.overflowed()
        res["garbage_rows"] = int((~path.valid_rows()).sum())
    return res


def _paths_worker(ctx, policies):
    import torch.distributed as dist

    layout = EPLayout(ctx.rank, ctx.world_size, E, ctx.group)
    x, ids, w, is_padding = make_inputs(ctx.rank)
    out = {}
    for masked in (True, False):
        mask = is_padding if masked else None
        max_rows = max_rows_per_pair(ids, mask, layout)
        paths = {"agrs": AGRSPath(layout, hidden=H, top_k=K), "a2a": A2APath(layout, hidden=H, top_k=K)}
        for policy in policies:
            cap = capacity_for(policy, max_rows, T)
            paths[f"a2a_fixed.{policy}"] = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T, capacity=cap)
        # the same semantics in plain torch (no interpreter): the reference kernels in the path
        paths["a2a_fixed.torch"] = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T,
                                                capacity=capacity_for("exact", max_rows, T), use_triton=False)
        for name, path in paths.items():
            seed = 77 + ctx.rank if name.startswith("a2a_fixed") else None
            res = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=seed)
            if name.startswith("a2a_fixed"):
                res["capacity"] = path.capacity
            out[(name, masked)] = res
        out[("max_rows", masked)] = max_rows
    # capacity one row short of the step's max: the overflow must be flagged (on the rank that overflows)
    max_rows = max_rows_per_pair(ids, is_padding, layout)
    small = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T, capacity=max(1, max_rows - 1))
    small.dispatch(x, ids, w, is_padding)
    flag = torch.tensor([int(small.overflowed())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
    out["overflow_flagged"] = bool(flag.item()) or max_rows == 1
    out["interpret"] = os.environ.get("TRITON_INTERPRET")
    return out


def _bench_worker(ctx, impls, params):
    """Registered impls end to end on this rank (build -> check -> run)."""
    from moebench import inputs, registry
    from moebench.sweep import Params

    _use_router_or_stand_in(inputs)
    out = {}
    for impl_name in impls:
        for mask in (True, False):
            p = Params(**{**params, "mask": mask, "ep_size": ctx.world_size})
            impl = registry.get(impl_name)
            case = impl.build(p, ctx)
            res = case.check()
            case.run()
            for _, fn in case.stages:
                fn()
            out[(impl_name, mask)] = {"ok": res.ok, "detail": res.detail, "metrics": res.metrics,
                                      "info": case.info, "bytes": case.bytes_moved,
                                      "graph": case.graph_capturable}
            case.cleanup()
    return out


def _stand_in_route(p, batch, *, use_mask=None):
    """Softmax top-k in plain torch, used only while moebench.kernels.topk_softmax is not in the tree."""
    masked = p.mask if use_mask is None else use_mask
    probs = torch.softmax(batch.logits.float(), dim=-1)
    w, ids = torch.topk(probs, p.top_k, dim=-1)
    ids = ids.to(torch.int32)
    if masked:
        ids[batch.is_padding] = -1
        w[batch.is_padding] = 0.0
    return w, ids


def _use_router_or_stand_in(inputs_module):
    try:
        import moebench.kernels.topk_softmax  # noqa: F401
    except ModuleNotFoundError:
        inputs_module.route = _stand_in_route


# ---------------------------------------------------------------------------------------------------------------
# Multi-rank (gloo): one spawn per world size, many assertions on its results
# ---------------------------------------------------------------------------------------------------------------

POLICIES = ("exact", "pow2", "max")
PATHS = ("agrs", "a2a") + tuple(f"a2a_fixed.{p}" for p in POLICIES) + ("a2a_fixed.torch",)


@pytest.fixture(scope="module")
def runs():
    return {R: mdist.spawn(_paths_worker, R, backend="gloo", args=(POLICIES if R == 2 else ("exact",),),
                           timeout_s=240)
            for R in (2, 4)}


def _cases():
    for R in (2, 4):
        for name in PATHS:
            if R == 4 and name in ("a2a_fixed.pow2", "a2a_fixed.max"):
                continue
            for masked in (True, False):
                yield R, name, masked


@pytest.mark.parametrize("R,name,masked", list(_cases()))
def test_path_matches_single_process_reference(runs, R, name, masked):
    for rank, per_rank in enumerate(runs[R]):
        res = per_rank[(name, masked)]
        assert per_rank["interpret"] == os.environ.get("TRITON_INTERPRET")
        assert res["recv_ok"], f"rank {rank}: {res['recv_detail']}"
        assert res["combined_ok"], f"rank {rank}: {res['combined_detail']}"
        if name.startswith("a2a_fixed"):
            assert res["invalid_rows_clean"], f"rank {rank}: garbage rows past the counts kept live ids"
            assert not res["overflow"]


@pytest.mark.parametrize("R,name", sorted({(R, name) for R, name, _ in _cases()}))
def test_padded_rows_sent_only_when_not_masked(runs, R, name):
    masked = [r[(name, True)] for r in runs[R]]
    unmasked = [r[(name, False)] for r in runs[R]]
    if name == "agrs":
        # every row travels (all_gather), but masked padded rows must not carry a route anywhere
        assert sum(r["padded_rows_received"] for r in masked) == R * R * NUM_PADDING
        assert sum(r["padded_routes_received"] for r in masked) == 0
        assert sum(r["padded_routes_received"] for r in unmasked) > 0
    else:
        assert sum(r["padded_rows_received"] for r in masked) == 0
        # unmasked: each rank's padded rows go to the owners of experts 0 and E-1 (first and last rank)
        assert sum(r["padded_rows_received"] for r in unmasked) == R * NUM_PADDING * 2


@pytest.mark.parametrize("R", [2, 4])
def test_fixed_capacity_layout_and_policies(runs, R):
    for per_rank in runs[R]:
        for masked in (True, False):
            max_rows = per_rank[("max_rows", masked)]
            res = per_rank[("a2a_fixed.exact", masked)]
            assert res["capacity"] == max_rows
            assert res["garbage_rows"] == R * max_rows - sum(res["stats"]["rows_recv_per_src"])
            if R == 2:
                assert per_rank[("a2a_fixed.pow2", masked)]["capacity"] == min(1 << (max_rows - 1).bit_length(), T)
                assert per_rank[("a2a_fixed.max", masked)]["capacity"] == T
        assert per_rank["overflow_flagged"]


@pytest.mark.parametrize("R", [2, 4])
def test_traffic_accounting_is_consistent_across_ranks(runs, R):
    for masked in (True, False):
        for name in ("a2a", "a2a_fixed.exact", "agrs"):
            stats = [r[(name, masked)]["stats"] for r in runs[R]]
            for src in range(R):
                for dst in range(R):
                    assert stats[src]["rows_sent_per_dest"][dst] == stats[dst]["rows_recv_per_src"][src]
            for rank, s in enumerate(stats):
                assert s["bytes_include_own_rank"] is True
                row = H * 2 + K * 8
                assert s["dispatch_payload_bytes"] == s["recv_rows"] * row
                assert s["dispatch_payload_bytes_own"] == s["rows_recv_per_src"][rank] * row
            if name == "a2a":
                assert stats[0]["dispatch_wire_bytes"] == stats[0]["recv_rows"] * WIRE_ROW
    fixed = runs[R][0][("a2a_fixed.exact", True)]
    assert fixed["stats"]["dispatch_wire_bytes"] == R * fixed["capacity"] * WIRE_ROW
    # masking removes the padded rows' traffic
    a2a = [sum(r[("a2a", m)]["stats"]["recv_rows"] for r in runs[R]) for m in (True, False)]
    assert a2a[0] < a2a[1]


@pytest.fixture(scope="module")
def bench_runs():
    params = {"num_tokens": 16, "hidden": 64, "num_experts": 8, "top_k": 3, "padding_ratio": 0.25,
              "padding_fill": "repeat", "num_max_tokens_per_rank": 16, "capacity_policy": "pow2"}
    impls = ("dispatch.agrs", "dispatch.a2a", "dispatch.a2a_fixed")
    return mdist.spawn(_bench_worker, 2, backend="gloo", args=(impls, params), timeout_s=240)


@pytest.mark.parametrize("impl", ["dispatch.agrs", "dispatch.a2a", "dispatch.a2a_fixed"])
@pytest.mark.parametrize("mask", [True, False])
def test_registered_impls_check_on_two_ranks(bench_runs, impl, mask):
    for rank, per_rank in enumerate(bench_runs):
        res = per_rank[(impl, mask)]
        assert res["ok"], f"rank {rank}: {res['detail']}"
        info = res["info"]
        assert info["mask_aware"] is mask and info["bytes_include_own_rank"] is True
        assert res["bytes"] == info["dispatch_payload_bytes"] + info["combine_payload_bytes"] > 0
        if impl != "dispatch.agrs":
            assert (info["padded_rows_sent"] == 0) if mask else (info["padded_rows_sent"] > 0)
        if mask and impl != "dispatch.agrs":
            assert res["metrics"]["padded_rows_received"] == 0.0
        if impl == "dispatch.a2a_fixed":
            assert res["graph"] and info["capacity_policy"] == "pow2"
            assert info["capacity"] >= info["max_rows_per_pair"]


# ---------------------------------------------------------------------------------------------------------------
# In-process: one rank (ep_size 1 degenerates to local compute), kernels vs references, helpers
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("kind", ["agrs", "a2a", "a2a_fixed"])
def test_single_rank_paths(kind, masked):
    layout = EPLayout(0, 1, E)
    x, ids, w, is_padding = make_inputs(0, seed=3)
    if kind == "agrs":
        path = AGRSPath(layout, hidden=H, top_k=K)
    elif kind == "a2a":
        path = A2APath(layout, hidden=H, top_k=K)
    else:
        path = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T, capacity=T)
    res = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=5 if kind == "a2a_fixed" else None)
    assert res["recv_ok"], res["recv_detail"]
    assert res["combined_ok"], res["combined_detail"]
    if kind != "agrs":
        assert (res["padded_rows_received"] == 0) == masked


@pytest.mark.parametrize("impl", ["dispatch.agrs", "dispatch.a2a", "dispatch.a2a_fixed"])
def test_registered_impls_on_one_rank(impl, monkeypatch):
    """ep_size 1: no process group, the paths degenerate to local compute and still check out."""
    from moebench import inputs, registry
    from moebench.registry import RunContext
    from moebench.sweep import Params

    try:
        import moebench.kernels.topk_softmax  # noqa: F401
    except ModuleNotFoundError:
        monkeypatch.setattr(inputs, "route", _stand_in_route)
    p = Params(num_tokens=16, hidden=64, num_experts=8, top_k=3, padding_ratio=0.25, num_max_tokens_per_rank=16,
               capacity_policy="max")
    case = registry.get(impl).build(p, RunContext(device=torch.device("cpu")))
    res = case.check()
    assert res.ok, res.detail
    info = case.info
    assert info["rows_sent_per_dest"] == info["rows_recv_per_src"] and info["recv_rows_own"] == info["recv_rows"]
    assert case.routing.ep_size == 1 and case.bytes_moved > 0
    case.run()
    case.cleanup()


def _pack_inputs(R, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    send_pos, counts = send_positions(token_in_rank(ids, EPLayout(0, R, E)))
    return x, ids, w, send_pos, counts


@pytest.mark.parametrize("R,cap", [(2, 12), (4, 3), (2, 4)])  # (2, 4) and (4, 3) overflow some destinations
def test_pack_fixed_triton_matches_torch(R, cap):
    x, ids, w, send_pos, counts = _pack_inputs(R, cap, seed=R * 10 + cap)
    outs = []
    for fn in (pack_fixed, pack_fixed_torch):
        send_x = poison(torch.empty(R * cap, H, dtype=torch.bfloat16))
        send_meta = poison(torch.empty(R * cap, 2 * K + 1, dtype=torch.int32))
        fn(x, send_pos, ids, w, send_x, send_meta, cap, E // R)
        outs.append((send_x, send_meta))
    # whole buffers, poisoned slots included: unwritten slots must stay untouched
    assert compare_exact("send_x", outs[0][0], outs[1][0]).ok
    assert compare_exact("send_meta", outs[0][1], outs[1][1]).ok
    # and the reference writes what the contract says
    send_x, send_meta = outs[1]
    for t in range(T):
        for d in range(R):
            pos = int(send_pos[t, d])
            if 0 <= pos < cap:
                s = d * cap + pos
                assert torch.equal(send_x[s], x[t])
                g_ids = ids[t].long()
                loc = torch.where((g_ids >= d * (E // R)) & (g_ids < (d + 1) * (E // R)), g_ids - d * (E // R), -1)
                assert torch.equal(send_meta[s, :K].long(), loc)
                assert torch.equal(send_meta[s, K:2 * K].view(torch.float32), w[t])
                assert int(send_meta[s, 2 * K]) == t
    written = int(torch.clamp(counts, max=cap).sum())
    assert int((send_meta[:, 2 * K] != -0x5A5A5A5A).sum()) == written


@pytest.mark.parametrize("R,cap", [(2, 12), (4, 3)])
def test_combine_fixed_triton_matches_torch(R, cap):
    x, ids, w, send_pos, counts = _pack_inputs(R, cap, seed=R + cap)
    g = torch.Generator().manual_seed(9)
    back = torch.randn(R * cap, H, generator=g).to(torch.bfloat16)
    # rows past each block's count are garbage (NaN): they must never be read
    for d in range(R):
        back[d * cap + min(int(counts[d]), cap):(d + 1) * cap] = float("nan")
    got = poison(torch.empty(T, H, dtype=torch.bfloat16))
    ref = poison(torch.empty(T, H, dtype=torch.bfloat16))
    combine_fixed(back, send_pos, got, cap)
    combine_fixed_torch(back, send_pos, ref, cap)
    assert torch.isfinite(got.float()).all()
    res = compare_close("combined", got, ref, 1e-2, 4e-3)  # interpreter bf16 rounding may differ by one ulp
    assert res.ok, res.detail
    assert (got[(send_pos < 0).all(dim=1)] == 0).all()


def test_capacity_policies():
    assert capacity_for("exact", 37, 64) == 37
    assert capacity_for("pow2", 37, 64) == 64
    assert capacity_for("pow2", 33, 48) == 48  # capped at the buffer
    assert capacity_for("pow2", 32, 64) == 32
    assert capacity_for("max", 3, 64) == 64
    assert capacity_for("exact", 0, 64) == 1  # an empty step still gets a valid kernel
    with pytest.raises(ValueError, match="exceed the buffer"):
        capacity_for("exact", 65, 64)
    with pytest.raises(ValueError, match="unknown capacity policy"):
        capacity_for("biggest", 3, 64)


def test_routing_helpers():
    ids = torch.tensor([[0, 5, -1], [7, 6, -1], [-1, -1, -1], [1, 2, 3]], dtype=torch.int32)
    lay = EPLayout(0, 2, 8)
    assert torch.equal(token_in_rank(ids, lay), torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]], dtype=torch.bool))
    idx = destination_order(token_in_rank(ids, lay), 4)
    assert idx.tolist() == [0, 3, 0, 1]
    pad = torch.tensor([False, True, False, False])
    assert (effective_ids(ids, pad)[1] == -1).all() and torch.equal(effective_ids(ids, None), ids)
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 4, got: 3"):
        effective_ids(ids, pad[:3])
    with pytest.raises(ValueError, match="does not divide"):
        EPLayout(0, 3, 8)


def test_deepep_detection_and_skip_reason():
    from moebench import registry
    from moebench.dispatch import deepep
    from moebench.registry import RunContext

    try:
        import deep_ep  # noqa: F401
        have = True
    except Exception:
        have = False
    impl = registry.get("dispatch.deepep")
    reason = impl.available(RunContext(device=torch.device("cpu")))
    if not have:
        assert deepep.unavailable() == "deep_ep not installed" == reason
        assert registry.get("dispatch.deepep_v2").available(RunContext(device=torch.device("cpu"))) == reason
        with pytest.raises(RuntimeError, match="deep_ep not installed"):
            deepep.DeepEPNormalPath(EPLayout(0, 1, E), hidden=H, top_k=K)
    else:
        assert reason in (None, "deep_ep needs CUDA GPUs")


def test_validate_rejects_simulated_and_oversized_batches():
    from moebench import registry
    from moebench.sweep import Params

    assert "simulated" in registry.get("dispatch.a2a").validate(Params(ep_size=2, ep_mode="simulated"))
    assert "num_max_tokens_per_rank" in registry.get("dispatch.a2a_fixed").validate(
        Params(num_tokens=64, num_max_tokens_per_rank=32))
    assert registry.get("dispatch.a2a").validate(Params(num_tokens=64, num_max_tokens_per_rank=32)) is None


# ---------------------------------------------------------------------------------------------------------------
# GPU: two GPUs, NCCL
# ---------------------------------------------------------------------------------------------------------------

def _gpu_worker(ctx):
    from moebench.dispatch.base import max_rows_per_pair as mrpp

    layout = EPLayout(ctx.rank, ctx.world_size, 64, ctx.group)
    g = torch.Generator(device="cuda").manual_seed(ctx.rank)
    Tg, Hg, Kg = 256, 7168, 8
    x = torch.randn(Tg, Hg, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.argsort(torch.rand(Tg, 64, generator=g, device="cuda"), dim=1)[:, :Kg].to(torch.int32)
    w = torch.rand(Tg, Kg, generator=g, device="cuda")
    is_padding = torch.zeros(Tg, dtype=torch.bool, device="cuda")
    is_padding[Tg // 2:] = True
    out = {}
    for masked in (True, False):
        mask = is_padding if masked else None
        cap = capacity_for("pow2", mrpp(ids, mask, layout), Tg)
        for name, path in (("agrs", AGRSPath(layout, hidden=Hg, top_k=Kg, device="cuda")),
                           ("a2a", A2APath(layout, hidden=Hg, top_k=Kg, device="cuda")),
                           ("a2a_fixed", A2AFixedPath(layout, hidden=Hg, top_k=Kg, num_tokens=Tg, capacity=cap,
                                                      device="cuda"))):
            gs = 3 if name == "a2a_fixed" else None
            out[(name, masked)] = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=gs)
    # a2a_fixed captured once in a CUDA graph, replayed after the inputs change in place
    cap = capacity_for("max", 0, Tg)
    path = A2AFixedPath(layout, hidden=Hg, top_k=Kg, num_tokens=Tg, capacity=cap, device="cuda")
    res_out = torch.empty_like(x)

    def step():
        d = path.dispatch(x, ids, w, is_padding)
        y = scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)
        path.combine(y, d.handle, out=res_out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture (Triton compiles, NCCL sets up)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = {}
    for trial in range(2):
        x.copy_(torch.randn(Tg, Hg, generator=g, device="cuda").to(torch.bfloat16))
        ids.copy_(torch.argsort(torch.rand(Tg, 64, generator=g, device="cuda"), dim=1)[:, :Kg].to(torch.int32))
        poison(res_out)
        graph.replay()
        torch.cuda.synchronize()
        ref = scaled_expert_reference(x, effective_ids(ids, is_padding), w, layout.experts_per_rank)
        c = compare_close("graph", res_out, ref, 2e-2, 5e-3)
        replay[trial] = (c.ok, c.detail)
    out["graph"] = replay
    return out


@pytest.mark.gpu2
def test_nccl_paths_and_graph_replay_on_two_gpus():
    results = mdist.spawn(_gpu_worker, 2, backend="nccl", timeout_s=300)
    for rank, per_rank in enumerate(results):
        for key, res in per_rank.items():
            if key == "graph":
                for trial, (ok, detail) in res.items():
                    assert ok, f"rank {rank} replay {trial}: {detail}"
                continue
            assert res["recv_ok"], f"rank {rank} {key}: {res['recv_detail']}"
            assert res["combined_ok"], f"rank {rank} {key}: {res['combined_detail']}"
            if key[0] == "a2a_fixed":
                assert res["invalid_rows_clean"] and not res["overflow"]
            if key[1] and key[0] != "agrs":
                assert res["padded_rows_received"] == 0
