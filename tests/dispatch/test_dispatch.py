"""Dispatch paths (agrs, a2a, a2a_fixed; Triton and torch-reference variants) on gloo ranks (the session's pool of
tests/gloo_pool.py) against the single-process reference; the Triton kernels (interpreter) against their torch
references, exactly: the send plan, pack/combine in fixed-capacity and exact-block modes on wire-row views, id
localisation; the wire row layout; capacity policies; the stage timer; buffer reuse; the registered dispatch impls
end to end; DeepEP detection. GPU (2 GPUs): NCCL paths and a2a_fixed in a CUDA graph.
"""

import os

import pytest
import torch

from moebench.run import dist as mdist
from moebench.check import compare_close, compare_exact, poison
from moebench.dispatch.a2a import A2APath, destination_order
from moebench.dispatch.a2a_fixed import A2AFixedPath, max_rows_per_pair
from moebench.dispatch.agrs import AGRSPath
from moebench.dispatch.base import (DispatchPath, EPLayout, StageTimer, effective_ids, local_ids, package_paths,
                                    path_class, token_in_rank)
from moebench.dispatch.comm import GROW_ROWS, grow_rows
from moebench.dispatch.pack import (capacity_for, combine_fixed, combine_fixed_torch, pack_fixed, pack_fixed_torch,
                                    send_positions)
from moebench.dispatch.permute import (RowLayout, localize_ids, localize_ids_torch, plan_sends,
                                       plan_sends_torch)
from moebench.dispatch.reference import (check_received, count_padding_received, gather_inputs, scaled_expert,
                                         scaled_expert_reference)
from moebench.params import Params
from moebench.registry import RunContext

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


def cpu_paths() -> dict[str, type[DispatchPath]]:
    """The collection function of the path tests: every dispatch path moebench.dispatch registers that can run on
    CPU gloo ranks (a new path module gets the multi-rank and single-rank tests below without being named here)."""
    cpu = RunContext(device=torch.device("cpu"))
    return {name: cls for name, cls in package_paths().items() if cls.available(cpu) is None}


def path_point(R: int, capacity_policy: str = "exact") -> Params:
    """The point a registered path is built for (from_point) at this file's shapes."""
    return Params(num_tokens=T, hidden=H, top_k=K, num_experts=E, num_max_tokens_per_rank=T, ep_size=R,
                  capacity_policy=capacity_policy)


def round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=None):
    """Dispatch + expert + combine, then every check; returns a plain dict (picklable). `garbage_seed`: the path's
    prepare_check first (a2a_fixed: stale receive buffers full of valid-looking garbage)."""
    mask = is_padding if masked else None
    if garbage_seed is not None:
        path.prepare_check(torch.Generator(device=x.device).manual_seed(garbage_seed))
    out = poison(torch.empty_like(x))
    d = path.dispatch(x, ids, w, mask)
    y = scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)
    path.combine(y, d.handle, out=out)
    g = gather_inputs(x, ids, w, is_padding, masked, layout)
    recv = check_received(path, d, g)
    ref = scaled_expert_reference(x, effective_ids(ids, mask), w, layout.local_experts)
    comb = compare_close("combined", out, ref, 2e-2, 5e-3)
    extra = [c for c in path.extra_checks(d) if not c.ok]
    res = {"recv_ok": recv.ok, "recv_detail": recv.detail, "combined_ok": comb.ok, "combined_detail": comb.detail,
           "extra_detail": "; ".join(c.detail for c in extra), "receives": path.receives,
           "sends_weights": path.sends_weights, **count_padding_received(path, d, g), "stats": path.stats(d).as_info()}
    if isinstance(path, A2AFixedPath):
        res["invalid_rows_clean"] = path.invalid_rows_clean()
        res["overflow"] = path.overflowed()
        res["garbage_rows"] = int((~path.valid_rows()).sum())
    return res


def _paths_worker(ctx, names, policies, bench=None):
    """Every registered path of `names` (built by its from_point, as the bench builds it), then the variants of
    moebench's own paths that no point selects: the torch-reference kernels inside them, a2a_fixed's other
    capacity policies."""
    import torch.distributed as dist

    layout = EPLayout(ctx.rank, ctx.world_size, E, ctx.group)
    x, ids, w, is_padding = make_inputs(ctx.rank)
    out = {}
    for masked in (True, False):
        mask = is_padding if masked else None
        max_rows = max_rows_per_pair(ids, mask, layout)
        paths = {name: path_class(name).from_point(layout, path_point(ctx.world_size), ids, mask, torch.device("cpu"))
                 for name in names}
        paths.update({"agrs.torch": AGRSPath(layout, hidden=H, top_k=K, use_triton=False),
                      "a2a.torch": A2APath(layout, hidden=H, top_k=K, use_triton=False)})
        for policy in policies:
            cap = capacity_for(policy, max_rows, T)
            paths[f"a2a_fixed.{policy}"] = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T, capacity=cap)
        # the same semantics in plain torch (no interpreter): the reference kernels in the path
        paths["a2a_fixed.torch"] = A2AFixedPath(layout, hidden=H, top_k=K, num_tokens=T,
                                                capacity=capacity_for("exact", max_rows, T), use_triton=False)
        for name, path in paths.items():
            res = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=77 + ctx.rank)
            if isinstance(path, A2AFixedPath):
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
    if bench is not None:  # the registered impls in the same ranks (one spawn less)
        out["bench"] = _bench_worker(ctx, *bench)
    return out


def _bench_worker(ctx, impls, params):
    """Registered impls end to end on this rank (build -> check -> run)."""
    from moebench import registry
    from moebench.params import Params

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


# ---------------------------------------------------------------------------------------------------------------
# Multi-rank (gloo): one spawn per world size, many assertions on its results
# ---------------------------------------------------------------------------------------------------------------

# a2a_fixed's policies other than from_point's "exact" (the registered "a2a_fixed"), on two ranks only
POLICIES = ("pow2", "max")
VARIANTS = ("agrs.torch", "a2a.torch", "a2a_fixed.torch") + tuple(f"a2a_fixed.{p}" for p in POLICIES)
PATHS = tuple(cpu_paths())
BENCH_IMPLS = tuple(f"dispatch.{name}" for name in PATHS)
BENCH_PARAMS = {"num_tokens": 8, "hidden": 64, "num_experts": 8, "top_k": 3, "padding_ratio": 0.25,
                "padding_fill": "repeat", "num_max_tokens_per_rank": 16, "capacity_policy": "pow2"}


@pytest.fixture(scope="module")
def runs(gloo_ranks):
    """Both world sizes on the session's pool of gloo ranks (tests/gloo_pool.py: no spawn per module)."""
    return {R: gloo_ranks.run(_paths_worker, R, args=(PATHS, POLICIES, (BENCH_IMPLS, BENCH_PARAMS)) if R == 2 else
                              (PATHS, ()), timeout_s=240)
            for R in (4, 2)}  # the larger first: the pool starts at 4 ranks instead of growing


def _cases():
    for R in (2, 4):
        for name in PATHS + VARIANTS:
            if R == 4 and name in tuple(f"a2a_fixed.{p}" for p in POLICIES):
                continue
            for masked in (True, False):
                yield R, name, masked


def test_every_registered_path_is_tested_here_or_says_why_not():
    """The registry decides what the tests below cover: every path runs on the gloo ranks, unless it says why it
    cannot run on the CPU (DeepEP: its library and CUDA)."""
    cpu = RunContext(device=torch.device("cpu"))
    assert {"agrs", "a2a", "a2a_fixed"} <= set(PATHS)
    for name, cls in package_paths().items():
        assert name in PATHS or cls.available(cpu), name


@pytest.mark.parametrize("R,name,masked", list(_cases()))
def test_path_matches_single_process_reference(runs, R, name, masked):
    for rank, per_rank in enumerate(runs[R]):
        res = per_rank[(name, masked)]
        assert per_rank["interpret"] == os.environ.get("TRITON_INTERPRET")
        assert res["recv_ok"], f"rank {rank}: {res['recv_detail']}"
        assert res["combined_ok"], f"rank {rank}: {res['combined_detail']}"
        assert not res["extra_detail"], f"rank {rank}: {res['extra_detail']}"
        if name.startswith("a2a_fixed"):
            assert res["invalid_rows_clean"], f"rank {rank}: garbage rows past the counts kept live ids"
            assert not res["overflow"]


@pytest.mark.parametrize("R,name", sorted({(R, name) for R, name, _ in _cases()}))
def test_padded_rows_sent_only_when_not_masked(runs, R, name):
    masked = [r[(name, True)] for r in runs[R]]
    unmasked = [r[(name, False)] for r in runs[R]]
    if masked[0]["receives"] == "all":
        # every row travels (all_gather), but masked padded rows must not carry a route anywhere
        assert sum(r["padded_rows_received"] for r in masked) == R * R * NUM_PADDING
        assert sum(r["padded_routes_received"] for r in masked) == 0
        assert sum(r["padded_routes_received"] for r in unmasked) > 0
    else:
        assert sum(r["padded_rows_received"] for r in masked) == 0
        # unmasked: each rank's padded rows go to the owners of experts 0 and E-1 (first and last rank)
        if masked[0]["receives"] == "token":
            assert sum(r["padded_rows_received"] for r in unmasked) == R * NUM_PADDING * 2
        else:
            assert sum(r["padded_rows_received"] for r in unmasked) > 0


@pytest.mark.parametrize("R", [2, 4])
def test_fixed_capacity_layout_and_policies(runs, R):
    for per_rank in runs[R]:
        for masked in (True, False):
            max_rows = per_rank[("max_rows", masked)]
            res = per_rank[("a2a_fixed", masked)]
            assert res["capacity"] == max_rows
            assert res["garbage_rows"] == R * max_rows - sum(res["stats"]["rows_recv_per_src"])
            if R == 2:
                assert per_rank[("a2a_fixed.pow2", masked)]["capacity"] == min(1 << (max_rows - 1).bit_length(), T)
                assert per_rank[("a2a_fixed.max", masked)]["capacity"] == T
        assert per_rank["overflow_flagged"]


@pytest.mark.parametrize("R", [2, 4])
def test_traffic_accounting_is_consistent_across_ranks(runs, R):
    for masked in (True, False):
        for name in PATHS:
            stats = [r[(name, masked)]["stats"] for r in runs[R]]
            for src in range(R):
                for dst in range(R):
                    assert stats[src]["rows_sent_per_dest"][dst] == stats[dst]["rows_recv_per_src"][src]
            for rank, s in enumerate(stats):
                assert s["bytes_include_own_rank"] is True
                row = H * 2 + (K * 8 if runs[R][rank][(name, masked)]["sends_weights"] else 0)
                assert s["dispatch_payload_bytes"] == s["recv_rows"] * row
                assert s["dispatch_payload_bytes_own"] == s["rows_recv_per_src"][rank] * row
            if name == "a2a":
                assert stats[0]["dispatch_wire_bytes"] == stats[0]["recv_rows"] * WIRE_ROW
    fixed = runs[R][0][("a2a_fixed", True)]
    assert fixed["stats"]["dispatch_wire_bytes"] == R * fixed["capacity"] * WIRE_ROW
    # masking removes the padded rows' traffic (a path that receives every row moves them either way)
    for name in PATHS:
        if runs[R][0][(name, True)]["receives"] != "all":
            recv = [sum(r[(name, m)]["stats"]["recv_rows"] for r in runs[R]) for m in (True, False)]
            assert recv[0] < recv[1], name


@pytest.fixture(scope="module")
def bench_runs(runs):
    return [per_rank["bench"] for per_rank in runs[2]]


@pytest.mark.parametrize("impl", BENCH_IMPLS)
@pytest.mark.parametrize("mask", [True, False])
def test_registered_impls_check_on_two_ranks(bench_runs, impl, mask):
    receives_all = path_class(impl.split(".", 1)[1]).receives == "all"
    for rank, per_rank in enumerate(bench_runs):
        res = per_rank[(impl, mask)]
        assert res["ok"], f"rank {rank}: {res['detail']}"
        info = res["info"]
        assert info["mask_aware"] is mask and info["bytes_include_own_rank"] is True
        assert res["bytes"] == info["dispatch_payload_bytes"] + info["combine_payload_bytes"] > 0
        if not receives_all:
            assert (info["padded_rows_sent"] == 0) if mask else (info["padded_rows_sent"] > 0)
        if mask and not receives_all:
            assert res["metrics"]["padded_rows_received"] == 0.0
        if issubclass(path_class(impl.split(".", 1)[1]), A2AFixedPath):
            assert res["graph"] and info["capacity_policy"] == "pow2"
            assert info["capacity"] >= info["max_rows_per_pair"]


# ---------------------------------------------------------------------------------------------------------------
# In-process: one rank (ep_size 1 degenerates to local compute), kernels vs references, helpers
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("name", PATHS)
def test_single_rank_paths(name, masked):
    layout = EPLayout(0, 1, E)
    x, ids, w, is_padding = make_inputs(0, seed=3)
    path = path_class(name).from_point(layout, path_point(1, "max"), ids, is_padding if masked else None,
                                       torch.device("cpu"))
    res = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=5)
    assert res["recv_ok"], res["recv_detail"]
    assert res["combined_ok"], res["combined_detail"]
    assert not res["extra_detail"], res["extra_detail"]
    if path.receives != "all":
        assert (res["padded_rows_received"] == 0) == masked


@pytest.mark.parametrize("impl", BENCH_IMPLS)
def test_registered_impls_on_one_rank(impl):
    """ep_size 1: no process group, the paths degenerate to local compute and still check out."""
    from moebench import registry
    from moebench.registry import RunContext
    from moebench.params import Params

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


# -- the send plan, wire rows, exact-block pack/combine, id localisation --------------------------------------------

def _routing(T_, K_, E_, seed, dtype=torch.int32):
    """Random ids in [-1, E_ + 2): -1 slots and out-of-range ids (which route nowhere) included, repeats allowed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E_ + 2, (T_, K_), generator=g).to(dtype)
    pad = torch.rand(T_, generator=g) < 0.3
    return ids, pad


PLAN_CASES = [  # (T, K, E, R, capacity, id dtype)
    (37, 3, 8, 2, 0, torch.int32), (100, 8, 64, 4, 5, torch.int64), (40, 6, 24, 3, 0, torch.int32),
    (9, 1, 4, 1, 0, torch.int32), (0, 2, 4, 2, 3, torch.int32), (300, 8, 16, 8, 30, torch.int32),
    (40, 4, 128, 64, 0, torch.int32)]  # R = 64: the [rows, slots, destinations] variant (no 32-bit bit set)


@pytest.mark.parametrize("T_,K_,E_,R,cap,dt", PLAN_CASES)
@pytest.mark.parametrize("masked", [True, False])
def test_plan_sends_triton_matches_torch(T_, K_, E_, R, cap, dt, masked):
    ids, pad = _routing(T_, K_, E_, seed=T_ + K_ + R + cap, dtype=dt)
    mask = pad if masked else None
    send_pos = poison(torch.empty(T_, R, dtype=torch.int32))
    counts, offsets = poison(torch.empty(R, dtype=torch.int32)), poison(torch.empty(R, dtype=torch.int32))
    overflow = torch.zeros(1, dtype=torch.int32)
    plan_sends(ids, mask, E_ // R, R, E_, capacity=cap, send_pos=send_pos, counts=counts, offsets=offsets,
               overflow=overflow)
    ref_pos, ref_counts, ref_offsets, ref_over = plan_sends_torch(ids, mask, E_ // R, R, E_, cap)
    for name, got, ref in (("send_pos", send_pos, ref_pos), ("counts", counts, ref_counts),
                           ("offsets", offsets, ref_offsets)):
        res = compare_exact(name, got, ref)
        assert res.ok, res.detail
    assert int(overflow) == int(ref_over)
    # the reference against the older torch helpers: same slots, same counts before the cap
    in_rank = token_in_rank(effective_ids(ids.to(torch.int32), mask), EPLayout(0, R, E_))
    old_pos, old_counts = send_positions(in_rank)
    assert torch.equal(ref_pos, old_pos)
    assert torch.equal(ref_counts, torch.clamp(old_counts, max=cap) if cap else old_counts)
    assert bool(ref_over) == bool(cap and (old_counts > cap).any())
    if masked and T_:
        assert (send_pos[pad] == -1).all()


@pytest.mark.parametrize("T_,block_rows", [(1100, 16), (300, 32), (17, 16)])  # 69 blocks: two NB chunks of 64
@pytest.mark.parametrize("cap", [0, 40])
def test_plan_sends_many_blocks_match_torch(T_, block_rows, cap):
    """The cross-block prefix: many small blocks, with and without a capacity, masked."""
    ids, pad = _routing(T_, 4, 32, seed=T_ + block_rows, dtype=torch.int32)
    send_pos = poison(torch.empty(T_, 4, dtype=torch.int32))
    counts, offsets = poison(torch.empty(4, dtype=torch.int32)), poison(torch.empty(4, dtype=torch.int32))
    overflow = torch.zeros(1, dtype=torch.int32)
    plan_sends(ids, pad, 8, 4, 32, capacity=cap, send_pos=send_pos, counts=counts, offsets=offsets,
               overflow=overflow, block_rows=block_rows)
    ref_pos, ref_counts, ref_offsets, ref_over = plan_sends_torch(ids, pad, 8, 4, 32, cap)
    for name, got, ref in (("send_pos", send_pos, ref_pos), ("counts", counts, ref_counts),
                           ("offsets", offsets, ref_offsets)):
        res = compare_exact(name, got, ref)
        assert res.ok, res.detail
    assert int(overflow) == int(ref_over)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        plan_sends(ids, pad, 8, 4, 32, block_rows=24)
    with pytest.raises(ValueError, match="block_counts must be contiguous int32"):
        plan_sends(ids, pad, 8, 4, 32, block_rows=16, block_counts=torch.empty(3, dtype=torch.int32))


def test_plan_block_rows_do_not_follow_the_batch_size():
    """BLOCK_T is a constexpr of the plan kernels: a block size that followed T would recompile them per size."""
    from moebench.dispatch.permute import PLAN_TILE_ELEMENTS, plan_block_rows, plan_scratch

    for K, R in ((8, 2), (8, 8), (1, 1), (8, 64), (6, 3)):
        b = plan_block_rows(K, R)
        assert b >= 16 and b & (b - 1) == 0
        assert b == 16 or b * max(2, 1 << (K - 1).bit_length()) * (1 if R <= 32 else 64) <= PLAN_TILE_ELEMENTS
        for T in (1, 17, 4096, 65536):  # the scratch grows with T; the block size does not
            assert plan_scratch(T, K, R, "cpu").numel() == -(-T // b) * R


def test_a2a_graph_mode_needs_cuda():
    with pytest.raises(ValueError, match="graph=True needs a CUDA device"):
        A2APath(EPLayout(0, 2, 8), hidden=16, top_k=2, graph=True)
    assert not A2APath(EPLayout(0, 2, 8), hidden=16, top_k=2).graph  # CPU: eager, no capture


def test_plan_sends_overflow_is_sticky_and_mask_checked():
    ids, _ = _routing(50, 4, 8, seed=3)
    over = torch.ones(1, dtype=torch.int32)
    plan_sends(ids, None, 4, 2, 8, capacity=50, overflow=over)  # no overflow this time: the flag stays raised
    assert int(over) == 1
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 50, got: 49"):
        plan_sends(ids, torch.zeros(49, dtype=torch.bool), 4, 2, 8)


def test_row_layout_views_alias_one_aligned_row():
    lay = RowLayout(7168, 8, torch.bfloat16)
    assert lay.row_bytes % 32 == 0 and lay.meta_offset == 7168 * 2
    assert lay.row_bytes - lay.x_bytes - 4 * lay.meta_words < 32  # padding below one alignment unit
    small = RowLayout(H, K)
    assert small.row_bytes == WIRE_ROW
    buf = torch.zeros(5, small.row_bytes, dtype=torch.uint8)
    x, ids, w, src = small.x(buf), small.ids(buf), small.weights(buf), small.src_row(buf)
    assert x.stride(0) % 16 == 0 and small.meta(buf).stride(0) * 4 == small.row_bytes  # vectorisable rows
    g = torch.Generator().manual_seed(1)
    xv = torch.randn(5, H, generator=g).to(torch.bfloat16)
    wv = torch.rand(5, K, generator=g)
    x.copy_(xv)
    ids.copy_(torch.arange(15, dtype=torch.int32).view(5, K))
    w.copy_(wv)
    src.copy_(torch.arange(5, dtype=torch.int32) + 100)
    raw = buf.view(torch.int32)
    for r in range(5):  # the bytes of each row are the hidden row, then ids, weights, source row
        assert torch.equal(buf[r, :H * 2].view(torch.bfloat16), xv[r])
        m = raw[r, small.meta_offset // 4:small.meta_offset // 4 + 2 * K + 1]
        assert m[:K].tolist() == list(range(3 * r, 3 * r + 3)) and torch.equal(m[K:2 * K].view(torch.float32), wv[r])
        assert int(m[2 * K]) == 100 + r


@pytest.mark.parametrize("R,dt,masked", [(2, torch.int32, True), (3, torch.int64, False), (4, torch.int32, False)])
def test_pack_and_combine_exact_blocks_match_torch(R, dt, masked):
    """capacity 0 (the a2a path): blocks at the plan's offsets, wire-row views, int64 ids, padded rows unsent."""
    E_ = 4 * R
    ids, pad = _routing(T, K, E_, seed=40 + R, dtype=dt)
    mask = pad if masked else None
    g = torch.Generator().manual_seed(R)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    send_pos, counts, offsets, _ = plan_sends_torch(ids, mask, E_ // R, R, E_)
    S = int(counts.sum())
    lay = RowLayout(H, K)
    outs = []
    for fn in (pack_fixed, pack_fixed_torch):
        buf = lay.empty(S + 2, "cpu")
        poison(buf)
        fn(x, send_pos, ids, w, lay.x(buf), lay.meta(buf), 0, E_ // R, offsets=offsets)
        outs.append(buf)
    assert compare_exact("wire rows", outs[0], outs[1]).ok  # poisoned bytes (padding, spare rows) untouched too
    meta = lay.meta(outs[1])
    assert (outs[1][S:] == poison(torch.empty(1, dtype=torch.uint8))).all()  # spare rows never written
    for d in range(R):  # block d holds the rows that go to d, ascending, with ids local to d
        rows = meta[int(offsets[d]):int(offsets[d]) + int(counts[d]), 2 * K].tolist()
        assert rows == (send_pos[:, d] >= 0).nonzero().flatten().tolist()
    if masked:
        assert not set(meta[:S, 2 * K].tolist()) & set(pad.nonzero().flatten().tolist())
    # combine: back rows past S are NaN and never read
    back = torch.full((S + 2, H), float("nan"), dtype=torch.bfloat16)
    back[:S] = torch.randn(S, H, generator=g).to(torch.bfloat16)
    got, ref = poison(torch.empty(T, H, dtype=torch.bfloat16)), poison(torch.empty(T, H, dtype=torch.bfloat16))
    combine_fixed(back, send_pos, got, 0, offsets=offsets)
    combine_fixed_torch(back, send_pos, ref, 0, offsets=offsets)
    res = compare_close("combined", got, ref, 1e-2, 4e-3)  # interpreter bf16 rounding may differ by one ulp
    assert res.ok, res.detail
    assert (got[(send_pos < 0).all(dim=1)] == 0).all()
    with pytest.raises(ValueError, match="offsets"):
        combine_fixed(back, send_pos, got, 0)


def test_localize_ids_matches_torch_on_a_strided_view():
    g = torch.Generator().manual_seed(5)
    meta = torch.randint(-3, 40, (70, 2 * K + 1), generator=g, dtype=torch.int32)
    view = meta[:, :K]  # the id columns of a metadata buffer (row stride 2K+1)
    for rank in range(4):
        out = poison(torch.empty(70, K, dtype=torch.int32))
        localize_ids(view, rank * 8, 8, out=out)
        ref = localize_ids_torch(view, rank * 8, 8)
        assert compare_exact("local", out, ref).ok
        assert torch.equal(ref, local_ids(view, EPLayout(rank, 4, 32)))  # the path's torch helper agrees


def test_stage_timer_records_the_path_steps_in_order():
    layout = EPLayout(0, 1, E)
    x, ids, w, is_padding = make_inputs(0, seed=4)
    path = A2APath(layout, hidden=H, top_k=K)
    timer = StageTimer("cpu")
    path.timer = timer
    for _ in range(2):
        timer.begin()
        d = path.dispatch(x, ids, w, is_padding)
        timer.end()
    timer.begin()
    path.combine(scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights), d.handle)
    timer.end()
    table = timer.table()
    assert [r["label"] for r in table] == ["start", "plan", "pack", "count_exchange", "counts_on_host",
                                           "payload_a2a", "end", "reduce"]
    assert all(r["gpu_us"] is None and r["host_us"] >= 0 for r in table) and table[0]["host_us"] == 0
    path.timer = None
    path.dispatch(x, ids, w, is_padding)  # no timer: no marks
    assert len(timer.calls) == 3


def test_buffers_are_reused_across_steps():
    layout = EPLayout(0, 1, E)
    x, ids, w, is_padding = make_inputs(0, seed=6)
    path = A2APath(layout, hidden=H, top_k=K)
    d = path.dispatch(x, ids, w, is_padding)
    bufs = (path.send_buf.data_ptr(), path.recv_buf.data_ptr(), path.send_pos.data_ptr())
    path.combine(scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights), d.handle)
    back = path.back.data_ptr()
    d = path.dispatch(x, ids, w, None)  # more rows (padding sent), still within the grown buffers
    path.combine(scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights), d.handle)
    assert (path.send_buf.data_ptr(), path.recv_buf.data_ptr(), path.send_pos.data_ptr()) == bufs
    assert path.back.data_ptr() == back
    assert d.recv_x.data_ptr() == path.recv_buf.data_ptr()  # zero-copy receive views
    assert grow_rows(None, 1, lambda n: torch.empty(n)).shape[0] == GROW_ROWS


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
    from moebench.params import Params

    assert "simulated" in registry.get("dispatch.a2a").validate(Params(ep_size=2, ep_mode="simulated"))
    assert "num_max_tokens_per_rank" in registry.get("dispatch.a2a_fixed").validate(
        Params(num_tokens=64, num_max_tokens_per_rank=32))
    assert registry.get("dispatch.a2a").validate(Params(num_tokens=64, num_max_tokens_per_rank=32)) is None


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernels at the target shape (one GPU), then two GPUs with NCCL
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("R,cap", [(2, 0), (2, 2100), (8, 0), (8, 300)])  # the capped ones overflow
def test_kernels_bitwise_on_gpu_at_target_shape(R, cap):
    dev = torch.device("cuda")
    Tg, Hg, Kg, Eg = 4096, 7168, 8, 256
    g = torch.Generator(device=dev).manual_seed(R + cap)
    ids = torch.argsort(torch.rand(Tg, Eg, generator=g, device=dev), dim=1)[:, :Kg].to(torch.int32)
    ids[torch.rand(Tg, Kg, generator=g, device=dev) < 0.05] = -1
    pad = torch.rand(Tg, generator=g, device=dev) < 0.3
    x = torch.randn(Tg, Hg, generator=g, device=dev).to(torch.bfloat16)
    w = torch.rand(Tg, Kg, generator=g, device=dev)
    over = torch.zeros(1, dtype=torch.int32, device=dev)
    send_pos, counts, offsets = plan_sends(ids, pad, Eg // R, R, Eg, capacity=cap, overflow=over)
    ref = plan_sends_torch(ids, pad, Eg // R, R, Eg, cap)
    for name, got, r in zip(("send_pos", "counts", "offsets"), (send_pos, counts, offsets), ref[:3]):
        assert compare_exact(name, got, r).ok, name
    assert int(over) == int(ref[3])
    lay = RowLayout(Hg, Kg)
    rows = R * cap if cap else int(counts.sum())
    bufs = []
    for fn in (pack_fixed, pack_fixed_torch):
        buf = poison(lay.empty(rows, dev))
        fn(x, send_pos, ids, w, lay.x(buf), lay.meta(buf), cap, Eg // R, offsets=offsets)
        bufs.append(buf)
    assert compare_exact("wire rows", bufs[0], bufs[1]).ok
    back = torch.randn(rows, Hg, generator=g, device=dev).to(torch.bfloat16)
    outs = [poison(torch.empty(Tg, Hg, dtype=torch.bfloat16, device=dev)) for _ in range(2)]
    combine_fixed(back, send_pos, outs[0], cap, offsets=offsets)
    combine_fixed_torch(back, send_pos, outs[1], cap, offsets=offsets)
    assert compare_exact("combined", outs[0], outs[1]).ok  # fp32 in destination order, rounded once: bitwise
    meta = lay.meta(bufs[0])
    assert compare_exact("local", localize_ids(meta[:, :Kg], Eg // R, Eg // R),
                         localize_ids_torch(meta[:, :Kg], Eg // R, Eg // R)).ok


# ---------------------------------------------------------------------------------------------------------------
# GPU: two GPUs, NCCL
# ---------------------------------------------------------------------------------------------------------------

def _gpu_worker(ctx):
    from moebench.dispatch.a2a_fixed import max_rows_per_pair as mrpp

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
                           ("a2a.eager", A2APath(layout, hidden=Hg, top_k=Kg, device="cuda", graph=False)),
                           ("a2a_fixed", A2AFixedPath(layout, hidden=Hg, top_k=Kg, num_tokens=Tg, capacity=cap,
                                                      device="cuda"))):
            gs = 3 if name == "a2a_fixed" else None
            out[(name, masked)] = round_trip(path, x, ids, w, is_padding, masked, layout, garbage_seed=gs)
    # a2a's pre-payload graph replayed on new contents of the same buffers: every step must use its own counts
    # (a stale count on the host would mis-size the payload); routing skewed differently at each step
    a2a = A2APath(layout, hidden=Hg, top_k=Kg, device="cuda")
    xs, ids_s, ws, pad_s = x.clone(), ids.clone(), w.clone(), is_padding.clone()
    steps = {}
    for trial in range(4):
        xs.copy_(torch.randn(Tg, Hg, generator=g, device="cuda").to(torch.bfloat16))
        scores = torch.rand(Tg, 64, generator=g, device="cuda")
        scores[:, :32] += 0.3 * trial  # more and more routes to rank 0's experts
        ids_s.copy_(torch.argsort(scores, dim=1, descending=True)[:, :Kg].to(torch.int32))
        pad_s.copy_(torch.rand(Tg, generator=g, device="cuda") < 0.2 * trial)
        res = round_trip(a2a, xs, ids_s, ws, pad_s, True, layout)
        steps[trial] = (res["recv_ok"] and res["combined_ok"] and res["padded_rows_received"] == 0,
                        f"{res['recv_detail']} {res['combined_detail']}",
                        tuple(res["stats"]["rows_sent_per_dest"]))
    out["a2a_graph_steps"] = (steps, len(a2a.graphs))
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
    # the runner's multi-rank graph timing: every rank captures the step and replays it after a barrier
    from moebench.measure.timing import measure
    from moebench.params import Timing
    res = measure(step, Timing(mode="cuda_graph", warmup=2, iters=5, max_seconds=60.0), torch.device("cuda"),
                  graph_capturable=True, group=ctx.group, barrier=True)
    out["graph_timing"] = (res.mode, len(res.samples_us), res.ranks["world_size"] if res.ranks else 0)
    replay = {}
    for trial in range(2):
        x.copy_(torch.randn(Tg, Hg, generator=g, device="cuda").to(torch.bfloat16))
        ids.copy_(torch.argsort(torch.rand(Tg, 64, generator=g, device="cuda"), dim=1)[:, :Kg].to(torch.int32))
        poison(res_out)
        graph.replay()
        torch.cuda.synchronize()
        ref = scaled_expert_reference(x, effective_ids(ids, is_padding), w, layout.local_experts)
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
            if key == "graph_timing":
                assert res[0] == "cuda_graph" and res[1] == 5 and res[2] == 2, res
                continue
            if key == "a2a_graph_steps":
                steps, num_graphs = res
                for trial, (ok, detail, _) in steps.items():
                    assert ok, f"rank {rank} a2a graph step {trial}: {detail}"
                assert num_graphs == 1, "one capture for every step on the same buffers"
                assert len({sent for _, _, sent in steps.values()}) > 1, "the steps should send different counts"
                continue
            assert res["recv_ok"], f"rank {rank} {key}: {res['recv_detail']}"
            assert res["combined_ok"], f"rank {rank} {key}: {res['combined_detail']}"
            if key[0] == "a2a_fixed":
                assert res["invalid_rows_clean"] and not res["overflow"]
            if key[1] and key[0] != "agrs":
                assert res["padded_rows_received"] == 0
