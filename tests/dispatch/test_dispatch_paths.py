"""The dispatch path interface and registry: discovery finds the package's paths (names, descriptions, flags as
registered before the redesign); a new path is one class (a toy all-gather path defined here, registered with
nothing else edited, checks out through bench/dispatch's Case on one rank and on two gloo ranks, and its hooks are
wired); the a2a graph cache runs exactly one count exchange per step whether a rank hits or misses (CPU-verified
with real gloo collectives: graph capture itself needs CUDA); module hygiene (no private names imported across
modules, no module over 500 lines, the bench module names no path).
"""

import ast
from pathlib import Path

import pytest
import torch

from moebench import registry
from moebench.bench import dispatch as bench_dispatch
from moebench.check import CheckResult, compare_close
from moebench.dispatch.a2a import A2APath, GraphCache
from moebench.dispatch.base import (DispatchPath, Dispatched, EPLayout, ReceivedRows, dispatch_path, effective_ids,
                                    local_ids, package_paths, path_class, token_in_rank)
from moebench.dispatch.comm import all_gather_rows, reduce_scatter_rows
from moebench.dispatch.reference import check_received, gather_inputs, scaled_expert, scaled_expert_reference
from moebench.params import Params
from moebench.registry import RunContext

REPO = Path(__file__).resolve().parents[2]

# The impls and descriptions as registered before the paths moved to hooks and discovery
EXPECTED = {
    "agrs": "all-gather rows + routing, local experts on every row, reduce-scatter back",
    "a2a": "count exchange (host sync), permute by destination, exact-size all_to_all_single; scatter-sum back",
    "a2a_fixed": "fixed-capacity blocks per destination (capacity_policy), no host sync, graph-capturable; "
                 "Triton pack/combine with CAPACITY constexpr; garbage rows neutralised on receipt",
    "deepep": "DeepEP legacy Buffer: intranode normal mode, or low-latency mode with low_latency: true",
    "deepep_v2": "DeepEP V2 ElasticBuffer, do_expand=False, no CPU sync; rows past the count neutralised",
    "deepep_v2_expand": "DeepEP V2 ElasticBuffer, do_expand=True (one row per expert slot), no CPU sync",
}
TOY = "testonly_gather"
TOY_PARAMS = {"num_tokens": 16, "hidden": 64, "num_experts": 8, "top_k": 3, "padding_ratio": 0.25,
              "padding_fill": "repeat", "seed": 4}


# ---------------------------------------------------------------------------------------------------------------
# A new path in one class: all-gather everything, keep the rows routed here, reduce-scatter the outputs back
# ---------------------------------------------------------------------------------------------------------------

@dispatch_path(TOY, description="test-only: all-gather every row, keep the ones routed here, reduce-scatter back")
class GatherPath(DispatchPath):
    """Receives (token, rank) pairs like a2a, the simple way: a host sync picks this rank's rows of the gathered
    batch. Its hooks: prepare_check notes the check's seed, extra_checks asks that it ran and that the rows arrived
    in (source rank, source row) order, record_info names the gather."""

    receives = "token"

    def prepare_check(self, generator):
        self.check_seed = generator.initial_seed()

    def extra_checks(self, d):
        got = self.received(d)
        key = got.src_rank * d.handle[0] + got.src_row
        ordered = bool((key[1:] > key[:-1]).all())
        return [CheckResult(getattr(self, "check_seed", None) is not None and ordered,
                            "" if ordered else "rows out of order", {})]

    def record_info(self, p):
        return {"gathered_rows": p.num_tokens * self.layout.ep_size}

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None):
        lay = self.layout
        R, (T, K) = lay.ep_size, topk_ids.shape
        ids = effective_ids(topk_ids, is_padding)
        all_x = torch.empty(R * T, x.shape[1], dtype=x.dtype)
        all_ids = torch.empty(R * T, K, dtype=torch.int32)
        all_w = torch.empty(R * T, K, dtype=torch.float32)
        for out, inp in ((all_x, x), (all_ids, ids), (all_w, topk_weights.to(torch.float32))):
            all_gather_rows(out, inp.contiguous(), lay.group, R)
        local = local_ids(all_ids, lay)
        rows = (local >= 0).any(dim=1).nonzero().squeeze(1)
        return Dispatched(recv_x=all_x[rows], recv_topk_ids=local[rows], recv_topk_weights=all_w[rows],
                          num_recv=int(rows.numel()), handle=(T, rows),
                          send_counts=token_in_rank(ids, lay).sum(0),
                          recv_counts=torch.bincount(rows // T, minlength=R))

    def combine(self, expert_out, handle, out=None):
        lay = self.layout
        T, rows = handle
        full = torch.zeros(lay.ep_size * T, expert_out.shape[1], dtype=expert_out.dtype)
        full[rows] = expert_out
        out = torch.empty(T, expert_out.shape[1], dtype=expert_out.dtype) if out is None else out
        reduce_scatter_rows(out, full, lay.group, lay.ep_size)
        return out

    def received(self, d):
        T, rows = d.handle
        return ReceivedRows(row_index=torch.arange(rows.numel()), src_rank=rows // T, src_row=rows % T)


def _register_toy() -> registry.Impl:
    if f"dispatch.{TOY}" not in registry.all_impls():
        bench_dispatch.register_path_impl(GatherPath)
    return registry.get(f"dispatch.{TOY}")


def _run_toy(ctx) -> dict:
    """The registered toy impl end to end on this rank, masked and not (build -> check -> run, stages)."""
    impl = _register_toy()
    out = {}
    for mask in (True, False):
        case = impl.build(Params(**TOY_PARAMS, mask=mask, ep_size=ctx.world_size), ctx)
        res = case.check()
        case.run()
        for _, fn in case.stages:
            fn()
        out[mask] = {"ok": res.ok, "detail": res.detail, "metrics": res.metrics, "info": case.info,
                     "bytes": case.bytes_moved, "graph": case.graph_capturable}
        case.cleanup()
    return out


def _two_rank_worker(ctx):
    """Both two-rank checks of this module in one rank group (each spawned rank costs an interpreter start)."""
    return {"toy": _run_toy(ctx), "graph_cache": _graph_cache_worker(ctx)}


@pytest.fixture(scope="module")
def two_ranks(gloo_ranks):
    return gloo_ranks.run(_two_rank_worker, 2, timeout_s=240)  # the session's pool of gloo ranks (gloo_pool.py)


@pytest.fixture(scope="module")
def toy_two_ranks(two_ranks):
    return [r["toy"] for r in two_ranks]


def _assert_toy_ok(results, R):
    for rank, per_rank in enumerate(results):
        for mask, res in per_rank.items():
            assert res["ok"], f"rank {rank} mask={mask}: {res['detail']}"
            info = res["info"]
            assert info["path"] == TOY and info["mask_aware"] is mask and info["receives"] == "token"
            assert info["gathered_rows"] == TOY_PARAMS["num_tokens"] * R  # record_info
            assert res["bytes"] == info["dispatch_payload_bytes"] + info["combine_payload_bytes"] > 0
            assert not res["graph"]  # the class default
            assert (info["padded_rows_sent"] == 0) if mask else (info["padded_rows_sent"] > 0)
            if mask:
                assert res["metrics"]["padded_rows_received"] == 0.0


def test_new_path_on_one_rank():
    _assert_toy_ok([_run_toy(RunContext(device=torch.device("cpu")))], 1)


def test_new_path_on_two_gloo_ranks(toy_two_ranks):
    _assert_toy_ok(toy_two_ranks, 2)
    stats = [r[False]["info"] for r in toy_two_ranks]
    for src in range(2):
        for dst in range(2):
            assert stats[src]["rows_sent_per_dest"][dst] == stats[dst]["rows_recv_per_src"][src]


def test_new_path_hooks_are_wired(monkeypatch):
    """The bench calls the path's checks: a failing extra check fails the case; a path that drops a row fails the
    reference comparison."""
    impl = _register_toy()
    ctx = RunContext(device=torch.device("cpu"))
    p = Params(**TOY_PARAMS, mask=True)
    monkeypatch.setattr(GatherPath, "extra_checks", lambda self, d: [CheckResult(False, "toy says no", {})])
    res = impl.build(p, ctx).check()
    assert not res.ok and "toy says no" in res.detail
    monkeypatch.undo()

    real_dispatch = GatherPath.dispatch

    def drop_first_row(self, *args, **kw):
        d = real_dispatch(self, *args, **kw)
        T, rows = d.handle
        d.handle = (T, rows[1:])
        d.recv_x, d.recv_topk_ids, d.recv_topk_weights = d.recv_x[1:], d.recv_topk_ids[1:], d.recv_topk_weights[1:]
        return d

    monkeypatch.setattr(GatherPath, "dispatch", drop_first_row)
    assert not impl.build(p, ctx).check().ok


# ---------------------------------------------------------------------------------------------------------------
# Discovery and the hooks of the package's paths
# ---------------------------------------------------------------------------------------------------------------

def test_discovery_registers_one_impl_per_package_path():
    paths = package_paths()
    assert set(paths) == set(EXPECTED)
    assert TOY not in paths and path_class(TOY) is GatherPath  # registered from a test: not the package's
    impls = registry.all_impls()
    for name, desc in EXPECTED.items():
        impl = impls[f"dispatch.{name}"]
        assert paths[name].name == name and impl.description == desc == paths[name].description
        assert impl.targets == ("dispatch",) and impl.multi_rank and impl.mask_aware
    plugins = {n for n in impls if n.startswith("dispatch.") and n != f"dispatch.{TOY}"  # other tests' plugins
               and not path_class(n.split(".", 1)[1]).__module__.startswith("moebench.")}
    assert {n for n in impls if n.startswith("dispatch.")} - {f"dispatch.{n}" for n in EXPECTED} - plugins <= {
        f"dispatch.{TOY}"}
    with pytest.raises(ValueError, match="registered twice"):
        dispatch_path("a2a", description="another a2a")(type("Other", (DispatchPath,), {}))
    with pytest.raises(ValueError, match="unknown dispatch path"):
        path_class("carrier_pigeon")


def test_capability_flags_and_validate():
    flags = {n: (c.graph_capturable, c.buffers_sized_by_max_tokens) for n, c in package_paths().items()}
    # graph_capturable of the class; deepep low-latency (built by `deepep` with low_latency) is capturable itself
    assert flags == {"agrs": (True, False), "a2a": (False, False), "a2a_fixed": (True, True),
                     "deepep": (False, False), "deepep_v2": (True, True), "deepep_v2_expand": (True, True)}
    over = Params(num_tokens=64, num_max_tokens_per_rank=32)
    for name, cls in package_paths().items():
        assert "simulated" in cls.validate(Params(ep_size=2, ep_mode="simulated"))
        assert (cls.validate(over) is not None) == cls.buffers_sized_by_max_tokens, name
        assert cls.validate(Params()) is None


def test_a2a_fixed_sizes_its_capacity_from_the_point():
    from moebench import inputs

    p = Params(**TOY_PARAMS, mask=True, num_max_tokens_per_rank=16, capacity_policy="pow2")
    batch = inputs.make_batch(p, torch.device("cpu"))
    _, ids = inputs.route(p, batch)
    path = path_class("a2a_fixed").from_point(EPLayout(0, 1, 8), p, ids, batch.mask, torch.device("cpu"))
    rows = int((~batch.is_padding).sum())  # one rank: every real row goes to it
    assert path.max_rows_per_pair == rows and path.capacity == min(1 << (rows - 1).bit_length(), 16)
    assert path.record_info(p) == {"capacity": path.capacity, "capacity_policy": "pow2",
                                   "max_rows_per_pair": rows, "buffer_rows": 16}
    path.prepare_check(torch.Generator().manual_seed(1))
    assert torch.isnan(path.recv_x.float()).all() and not path.overflowed()  # garbage in, flag reset
    d = path.dispatch(batch.hidden, ids, torch.rand(ids.shape), batch.mask)
    assert path.extra_checks(d) == []
    path.recv_ids[-1] = 0  # a live id past the counts: the neutralisation check must see it
    assert [r.detail for r in path.extra_checks(d)] == ["a2a_fixed: receive rows past the counts kept live ids"]


# ---------------------------------------------------------------------------------------------------------------
# The a2a graph cache: one count exchange per step on every rank, hit or miss
# ---------------------------------------------------------------------------------------------------------------

class _Replay:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class _NoEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


def test_graph_cache_hit_replays_miss_runs_eagerly_and_captures():
    log = []
    cache = GraphCache(max_graphs=2)

    def step(key):
        graph = cache.lookup(key, eager=lambda: log.append(("eager", key)),
                             capture=lambda: _Replay(lambda: log.append(("replay", key))))
        if graph is not None:
            graph.replay()

    for key in ("a", "a", "b", "a", "c", "b", "b"):
        step(key)
    # one run per step; a miss is never also replayed; "b" was evicted by "c" (least recently used after "a")
    assert log == [("eager", "a"), ("replay", "a"), ("eager", "b"), ("replay", "a"), ("eager", "c"),
                   ("eager", "b"), ("replay", "b")]
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0


class CpuGraphA2A(A2APath):
    """A2APath in graph mode on a CPU: a "capture" keeps the inputs it was given and its "replay" runs the eager
    pre-payload stage on them (what a CUDA graph replays: the same addresses, their current contents), so the
    cache's hit/miss logic and dispatch's use of it run against real collectives. Counts pre-payload runs."""

    def __init__(self, layout, **kw):
        super().__init__(layout, graph=False, **kw)
        self.graph = True
        self.counts_ready_graph = _NoEvent()
        self.pre_payload_runs = 0

    def _pre_payload(self, *args, **kw):
        self.pre_payload_runs += 1
        return super()._pre_payload(*args, **kw)

    def _eager_step(self, x, topk_ids, topk_weights, is_padding, T):
        self._pre_payload(x, topk_ids, topk_weights, is_padding, T, record=_NoEvent())  # counts to the host

    def _capture(self, x, topk_ids, topk_weights, is_padding, T):
        return _Replay(lambda: self._pre_payload(x, topk_ids, topk_weights, is_padding, T, record=_NoEvent()))


def _graph_cache_worker(ctx):
    """Four steps with new routing each; rank 1 gets new input tensors (a cache miss) at step 2 while rank 0 hits,
    rank 0 at step 3 while rank 1 hits. Every step must still be right."""
    T, H, K, E = 12, 32, 3, 8
    layout = EPLayout(ctx.rank, ctx.world_size, E, ctx.group)
    path = CpuGraphA2A(layout, hidden=H, top_k=K)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.empty(T, H, dtype=torch.bfloat16)
    ids = torch.empty(T, K, dtype=torch.int32)
    w = torch.empty(T, K)
    pad = torch.zeros(T, dtype=torch.bool)
    steps = []
    for step in range(4):
        if (ctx.rank, step) in ((1, 2), (0, 3)):
            x, ids, w, pad = x.clone(), ids.clone(), w.clone(), pad.clone()  # new addresses: a miss here
        x.copy_(torch.randn(T, H, generator=g).to(torch.bfloat16))
        scores = torch.rand(T, E, generator=g)
        scores[:, :E // 2] += 0.3 * step * (1 if ctx.rank == 0 else -1)  # counts change from step to step
        ids.copy_(torch.argsort(scores, dim=1, descending=True)[:, :K].to(torch.int32))
        w.copy_(torch.rand(T, K, generator=g))
        pad.copy_(torch.rand(T, generator=g) < 0.25)
        runs = path.pre_payload_runs
        d = path.dispatch(x, ids, w, pad)
        out = path.combine(scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights), d.handle)
        recv = check_received(path, d, gather_inputs(x, ids, w, pad, True, layout))
        comb = compare_close("combined", out, scaled_expert_reference(x, effective_ids(ids, pad), w, E // 2),
                             2e-2, 5e-3)
        steps.append({"ok": recv.ok and comb.ok, "detail": f"{recv.detail} {comb.detail}",
                      "exchanges": path.pre_payload_runs - runs, "sent": tuple(d.send_counts)})
    return {"steps": steps, "graphs": len(path.graphs)}


def test_a2a_graph_cache_pairs_count_exchanges_when_ranks_miss_apart(two_ranks):
    for rank, res in enumerate(r["graph_cache"] for r in two_ranks):
        for i, s in enumerate(res["steps"]):
            assert s["ok"], f"rank {rank} step {i}: {s['detail']}"
            assert s["exchanges"] == 1, f"rank {rank} step {i}: {s['exchanges']} count exchanges"
        assert res["graphs"] == 2
        assert len({s["sent"] for s in res["steps"]}) > 1  # the counts did change between steps


# ---------------------------------------------------------------------------------------------------------------
# Module hygiene
# ---------------------------------------------------------------------------------------------------------------

MODULES = sorted((REPO / "moebench" / "dispatch").glob("*.py")) + [REPO / "moebench" / "bench" / "dispatch.py",
                                                                  REPO / "moebench" / "bench" / "jit_trace.py"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_private_names_imported_and_no_module_over_500_lines(path):
    src = path.read_text()
    assert len(src.splitlines()) <= 500
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moebench"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name} imports {private} from {node.module}"


def test_bench_module_names_no_path():
    src = (REPO / "moebench" / "bench" / "dispatch.py").read_text()
    tree = ast.parse(src)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for path in EXPECTED:
        assert path not in names and not any(path in s.split() for s in strings), path
    assert "kind" not in names
