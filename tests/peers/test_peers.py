"""Peers: the torch.compile peers at small shapes, the library adapters against stand-ins with the libraries' call
signatures (tests/standins), and the ratio of every impl to the best peer at the same point."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

from moebench import registry
from moebench.peers import sglang as peers_sglang, vllm as peers_vllm
from moebench.peers._lib import libraries
from moebench.peers.compile import FORMULATIONS, compile_available
from moebench.report.peers import compare_within, peer_footer_lines, peer_ratios
from tests.peers.peer_checks import CPU, checked as _check, params as _params
from tests.standins import sgl_kernel_standin, standins as standin_modules, vllm_ops

SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
             padding_ratio=0.25, num_max_tokens_per_rank=16)
GROUPED = dict(SMALL, num_expert_group=4, topk_group=2, scoring="sigmoid", bias=True, routed_scaling_factor=2.5)
TESTS = Path(__file__).resolve().parent
# A family's own knobs, where SMALL is not a point every peer of it takes.
FAMILY_POINTS = {"grouped_topk": GROUPED, "apply_expert_map": dict(SMALL, ep_size=2),
                 "globalize_recv_topk_idx": dict(SMALL, ep_size=2)}
# fp8 block-scaled experts: 128x128 weight blocks, fp32 group-128 staging
FP8 = dict(SMALL, num_local_experts=4, top_k=3, hidden=256, intermediate=128, group_size=128, scale_format="fp32")
IMPL_POINTS = {"fused_experts.fp8_vllm": FP8}  # (tests/peers/test_peers_vllm_experts.py checks these peers further)


def peer_point(impl: registry.Impl) -> dict:
    """The small point a peer is checked at: its own, else its family's, else SMALL."""
    return IMPL_POINTS.get(impl.name, FAMILY_POINTS.get(impl.kernel, SMALL))


def own_test_file(library: str) -> Path | None:
    """tests/peers/test_peers_<module>.py of the moebench.peers module holding the library, when it has one of its own (its
    peers are checked there, at the points its library needs: DeepGEMM's fp8 blocks)."""
    for info in pkgutil.iter_modules(importlib.import_module(registry.PEERS_PACKAGE).__path__):
        module = importlib.import_module(f"{registry.PEERS_PACKAGE}.{info.name}")
        if libraries()[library] in vars(module).values():
            path = TESTS / f"test_peers_{info.name}.py"
            return path if path.is_file() else None
    return None




# ---------------------------------------------------------------------------------------------------------------
# torch.compile peers
# ---------------------------------------------------------------------------------------------------------------

def compile_points() -> dict[str, dict]:
    """The collection function of the torch.compile peers: every registered one, at its peer_point."""
    return {name: peer_point(impl) for name, impl in sorted(registry.all_impls().items())
            if impl.library == "torch.compile"}


COMPILE_POINTS = compile_points()


@pytest.mark.skipif(compile_available(CPU) is not None, reason=str(compile_available(CPU)))
@pytest.mark.parametrize("name", sorted(COMPILE_POINTS))
def test_compile_peer_passes_its_check_and_records_compile_time(name):
    impl = registry.get(name)
    assert impl.library == "torch.compile"
    case, res = _check(name, _params(**COMPILE_POINTS[name]))
    assert res.ok, res.detail
    assert case.info["compile_seconds"] > 0  # compiled in build, outside any timed region
    assert case.bytes_moved > 0 and case.routing is not None


def test_compile_peers_cover_the_plain_torch_families():
    assert set(COMPILE_POINTS) == {f"{family}.compile" for family in FORMULATIONS} != set()


# ---------------------------------------------------------------------------------------------------------------
# Library adapters against stand-ins
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(name="standins")
def bound_standins():
    """Every peer library with a stand-in (tests/standins) bound to it, for the test."""
    libs = libraries()
    saved = [(libs[name], libs[name].lib, libs[name].reason) for name in standin_modules()]
    for name, module in standin_modules().items():
        libs[name].bind(module)
    yield
    for lib, mod, reason in saved:
        lib.lib, lib.reason = mod, reason


LARGE_ALIGN = dict(SMALL, num_tokens=512)  # 1024 routes: vLLM's two-block alignment, not its small-batch kernel

# Points of particular library code paths, beside each adapter's own point (adapter_points)
EXTRA_ADAPTER_POINTS = {
    "topk_softmax.vllm@bias": dict(SMALL, bias=True),
    "moe_align_block_size.vllm@large": LARGE_ALIGN,
    "moe_align_block_size.vllm@large_map": dict(LARGE_ALIGN, num_local_experts=4),
    "masked_moe_sum.vllm@top_k4": dict(SMALL, top_k=4),
    "masked_moe_sum.vllm@top_k8": dict(SMALL, top_k=8),
    "moe_align_block_size.vllm@map": dict(SMALL, num_local_experts=4),
    "moe_align_block_size.sglang@map": dict(SMALL, num_local_experts=4),
}


def adapter_points() -> dict[str, dict]:
    """The collection function of the library adapters: label -> point for every registered peer of a library that
    has a stand-in and no test file of its own (each at its peer_point), then the extra points (`<impl>@<what>`)."""
    with_standin = {name for name in standin_modules() if own_test_file(name) is None}
    own = {name: peer_point(impl) for name, impl in sorted(registry.all_impls().items())
           if impl.library in with_standin}
    return {**own, **EXTRA_ADAPTER_POINTS}


ADAPTER_POINTS = adapter_points()


def test_every_peer_library_has_a_standin_and_every_peer_is_checked_here():
    """A peer is an adapter plus a stand-in: each Library of moebench.peers has one in tests/standins, so each of its
    registered impls is in adapter_points or in its module's own test file (the torch.compile and torch peers run
    for real: compile_points, the contract test)."""
    assert set(libraries()) == set(standin_modules()) >= {"vllm", "sglang", "flashinfer", "deep_gemm", "triton_kernels"}
    assert own_test_file("deep_gemm") == TESTS / "test_peers_deepgemm.py" and own_test_file("vllm") is None
    assert own_test_file("triton_kernels") == TESTS / "test_peers_matmul_ogs.py"
    for name, impl in registry.all_impls().items():
        if impl.library in libraries():
            assert name in ADAPTER_POINTS or own_test_file(impl.library), name
    assert {label.split("@")[0] for label in EXTRA_ADAPTER_POINTS} <= set(ADAPTER_POINTS)


@pytest.mark.parametrize("label", sorted(ADAPTER_POINTS))
def test_adapter_passes_the_reference_check_against_its_standin(standins, label):
    name = label.split("@")[0]
    impl = registry.get(name)
    assert impl.library in libraries()
    case, res = _check(name, _params(**ADAPTER_POINTS[label]))
    assert res.ok, res.detail
    case.run()  # what is timed runs again on the same buffers


def test_vllm_moe_sum_is_recorded_as_the_oblivious_reduction(standins):
    impl = registry.get("masked_moe_sum.vllm")
    assert not impl.mask_aware
    case, res = _check("masked_moe_sum.vllm", _params(**SMALL))
    assert res.ok and case.info["nan_rows"] > 0  # the padded rows' NaN reach its output, as they would in vLLM


def test_adapters_refuse_points_their_library_cannot_express(standins):
    assert "bias" in registry.get("grouped_topk.vllm").validate(_params(**SMALL))
    assert "sigmoid" in registry.get("grouped_topk.flashinfer").validate(_params(**SMALL))
    assert registry.get("topk_softmax.vllm").validate(_params(**dict(SMALL, bias=True))) is None  # it takes a bias

    def without_bias(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False):
        vllm_ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize)

    peers_vllm.VLLM.bind(type("v", (), {"topk_softmax": staticmethod(without_bias), "MOEBENCH_STANDIN": True}))
    assert "bias" in registry.get("topk_softmax.vllm").validate(_params(**dict(SMALL, bias=True)))


def test_vllm_topk_softmax_of_fp32_gating_only_gets_the_cast_its_own_caller_made(standins):
    def fp32_only(topk_weights, topk_ids, token_expert_indices, gating_output):
        if gating_output.dtype != torch.float32:  # the older kernel's TORCH_CHECK, as torch words it
            raise RuntimeError(f"expected scalar type Float but found {str(gating_output.dtype)[6:].title()}")
        vllm_ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output)

    peers_vllm.VLLM.bind(type("v", (), {"topk_softmax": staticmethod(fp32_only), "MOEBENCH_STANDIN": True}))
    case, res = _check("topk_softmax.vllm", _params(**dict(SMALL, dtype="bf16")))
    assert res.ok, res.detail
    assert "cast to fp32" in case.info["vllm_topk_softmax_gating"]


@pytest.mark.parametrize("label, kernel, sentinel", [
    ("moe_align_block_size.vllm", "small-batch", "identity expert_map"),
    ("moe_align_block_size.vllm@map", "small-batch", "global expert 7"),
    ("moe_align_block_size.vllm@large", "two-block", "num_experts"),
    ("moe_align_block_size.vllm@large_map", "two-block", "num_experts"),
])
def test_vllm_align_records_its_kernel_and_the_sentinel_it_was_handed(standins, label, kernel, sentinel):
    case, res = _check("moe_align_block_size.vllm", _params(**ADAPTER_POINTS[label]))
    assert res.ok, res.detail
    assert case.info["vllm_align_kernel"] == kernel and sentinel in case.info["vllm_align_sentinel"]


def test_the_vllm_standin_refuses_what_the_real_alignment_reads_out_of_bounds():
    out = lambda n: (torch.empty(n + 8 * 15, dtype=torch.int32), torch.empty(n // 16 + 8, dtype=torch.int32),
                     torch.empty(1, dtype=torch.int32))
    with_skipped = torch.tensor([[0, -1], [3, 1]], dtype=torch.int32)
    with pytest.raises(IndexError, match="negative"):
        vllm_ops.moe_align_block_size(with_skipped, 8, 16, *out(4))
    # the small-batch kernel has no range check: num_experts is no sentinel there
    with pytest.raises(IndexError, match="small-batch"):
        vllm_ops.moe_align_block_size(torch.where(with_skipped < 0, 8, with_skipped), 8, 16, *out(4))
    # the two-block kernel (>= 1024 routes) skips it
    many = torch.full((512, 2), 8, dtype=torch.int32)
    many[0, 0] = 5
    sorted_ids, expert_ids, num_post = out(1024)
    vllm_ops.moe_align_block_size(many, 8, 16, sorted_ids, expert_ids, num_post)
    assert int(num_post) == 16 and int(sorted_ids[0]) == 0 and int(expert_ids[0]) == 5


@pytest.mark.parametrize("shape", [SMALL, LARGE_ALIGN])
def test_the_old_vllm_align_adapter_handing_minus_one_fails_against_the_standin(standins, shape):
    from moebench.bench.align import align_build_for

    def hands_minus_one(topk_ids, num_experts, block_size, expert_map=None, *, out=None, workspace=None):
        vllm_ops.moe_align_block_size(topk_ids, num_experts, block_size, *out)  # the pre-fix adapter
        return out

    case = align_build_for(hands_minus_one, canonical=True)(_params(**shape), CPU)
    with pytest.raises(IndexError, match="negative"):
        case.check()


def test_vllm_moe_sum_records_which_path_ran_and_its_precision_class(standins):
    # top_k 4: bf16 accumulation leaves the fp32 tolerances the point used to be judged by (recorded wrong, untimed)
    # but stays in its precision class; top_k 2 rounds once like the fp32 sum; top_k 8 is torch's sum
    for top_k, path, accumulation in ((4, "moe_sum_kernel<topk=4>", "bf16"), (8, "sum_out fallback", "fp32"),
                                      (2, "moe_sum_kernel<topk=2>", "fp32")):
        case, res = _check("masked_moe_sum.vllm", _params(**dict(SMALL, top_k=top_k, hidden=512)))
        assert res.ok, res.detail
        assert path in case.info["moe_sum_path"] and "bf16 ulps" in case.info["precision"]
        assert case.info["accumulation"].startswith(accumulation), (top_k, case.info["accumulation"])
        assert res.metrics["out.max_ulps"] <= top_k / 2


def test_vllm_grouped_topk_says_its_copy_is_timed(standins):
    case, res = _check("grouped_topk.vllm", _params(**GROUPED))
    assert res.ok and "copy" in case.info["vllm_grouped_topk"]


def test_the_sglang_standin_refuses_ids_past_its_buckets():
    ids = torch.tensor([[0, 8]], dtype=torch.int32)  # num_experts as a sentinel: past SGLang's shared counters
    bufs = (torch.empty(64, dtype=torch.int32), torch.empty(8, dtype=torch.int32), torch.empty(1, dtype=torch.int32),
            torch.empty(10, dtype=torch.int32))
    with pytest.raises(IndexError, match="out-of-bounds"):
        sgl_kernel_standin.moe_align_block_size(ids, 9, 16, *bufs, True)


def test_absent_library_says_why(monkeypatch):
    lib = peers_vllm.VLLM
    monkeypatch.setattr(lib, "lib", None)
    monkeypatch.setattr(lib, "reason", "vllm is not installed (no module 'vllm')")
    assert registry.get("topk_softmax.vllm").available(CPU) == "vllm is not installed (no module 'vllm')"


def test_a_wrong_library_result_is_caught_after_the_layout_is_normalised(standins, monkeypatch):
    def drops_a_route(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                      expert_map=None):
        vllm_ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                                      num_tokens_post_pad, expert_map)
        sorted_token_ids[0] = topk_ids.numel()  # the first route of the first expert goes missing

    broken = type("broken", (), {"moe_align_block_size": staticmethod(drops_a_route), "MOEBENCH_STANDIN": True})
    peers_vllm.VLLM.bind(broken)
    _, res = _check("moe_align_block_size.vllm", _params(**SMALL))
    assert not res.ok and "sorted_token_ids" in res.detail


def test_a_router_that_ignores_the_mask_is_wrong(standins, monkeypatch):
    # a version that takes is_padding but ignores it: the adapter trusts it, the check catches it
    def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False,
                     is_padding=None):
        vllm_ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize)

    peers_vllm.VLLM.bind(type("v", (), {"topk_softmax": staticmethod(topk_softmax), "MOEBENCH_STANDIN": True}))
    _, res = _check("topk_softmax.vllm", _params(**SMALL))
    assert not res.ok and "padded rows" in res.detail


# ---------------------------------------------------------------------------------------------------------------
# Ratio to the best peer
# ---------------------------------------------------------------------------------------------------------------

def _rec(impl, p50, library=None, status="ok", **params):
    return {"point": 0, "impl": impl, "kernel": impl.split(".")[0], "library": library, "status": status,
            "params": {"num_tokens": 8, **params}, "stats": {"p50": p50}}


def test_peer_ratio_is_against_the_fastest_other_peer_at_the_same_point():
    recs = [_rec("topk_softmax.triton", 10.0), _rec("topk_softmax.compile", 120.0, "torch.compile"),
            _rec("topk_softmax.vllm", 40.0, "vllm"), _rec("topk_softmax.sglang", 5.0, "sglang", status="failed"),
            _rec("topk_softmax.triton", 20.0, num_tokens=16),  # another point: no peer there
            _rec("grouped_topk.compile", 1.0, "torch.compile")]  # another family
    rows = {r["impl"]: r for r in peer_ratios(recs)}
    assert set(rows) == {"topk_softmax.triton", "topk_softmax.compile", "topk_softmax.vllm"}
    assert rows["topk_softmax.triton"]["best_peer"] == "topk_softmax.vllm"
    assert rows["topk_softmax.triton"]["ratio"] == pytest.approx(0.25)
    assert rows["topk_softmax.vllm"]["best_peer"] == "topk_softmax.compile"  # the fastest *other* peer
    assert rows["topk_softmax.vllm"]["ratio"] == pytest.approx(40 / 120)
    lines = peer_footer_lines(recs)
    assert any("topk_softmax.triton" in line and "0.250" in line for line in lines)
    assert peer_footer_lines([_rec("topk_softmax.triton", 10.0)]) == []


def test_peer_ratio_pairs_bf16_and_fp8_experts_apart():
    def rec(impl, p50, dtype, library=None):
        return {**_rec(impl, p50, library), "info": {"expert_dtype": dtype} if dtype else {}}

    recs = [rec("fused_experts.triton", 10.0, "bf16"), rec("fused_experts.grouped_mm", 12.0, "bf16", "torch"),
            rec("fused_experts.fp8", 8.0, "fp8"), rec("fused_experts.fp8_scaled_grouped_mm", 7.0, "fp8", "torch"),
            rec("fused_experts.vllm", 11.0, None, "vllm")]  # names no dtype: compared with either
    rows = {r["impl"]: r for r in peer_ratios(recs)}
    assert rows["fused_experts.triton"]["best_peer"] == "fused_experts.vllm"  # not the faster fp8 peer
    assert rows["fused_experts.fp8"]["best_peer"] == "fused_experts.fp8_scaled_grouped_mm"
    assert rows["fused_experts.grouped_mm"]["best_peer"] == "fused_experts.vllm"


def test_compare_within_pairs_impls_by_parameters():
    recs = [_rec("a.x", 10.0), _rec("a.y", 5.0), _rec("a.x", 8.0, num_tokens=16), _rec("a.y", 1.0, status="wrong",
                                                                                          num_tokens=16)]
    rows = compare_within(recs, "a.x", "a.y")
    assert [(r["params"]["num_tokens"], r["ratio"]) for r in rows] == [(8, 0.5)]


def test_peer_ratio_plot_is_drawn_from_the_records(tmp_path):
    import json

    from moebench.plots import make_plots

    run = tmp_path / "results" / "run1"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"sweep": {"name": "p", "axes": {"num_tokens": [8, 16]}}}))
    recs = []
    for t in (8, 16):
        recs += [_rec("topk_softmax.triton", 10.0 * t, num_tokens=t),
                 _rec("topk_softmax.compile", 30.0 * t, "torch.compile", num_tokens=t),
                 _rec("topk_softmax.vllm", 20.0 * t, "vllm", num_tokens=t)]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    paths = make_plots(run, tmp_path / "plots")
    assert [p.name for p in paths if p.name.startswith("peer_ratio")] == ["peer_ratio.png"]


def test_compare_within_one_run_from_the_command_line(tmp_path, capsys):
    import json

    from moebench.cli import main

    run = tmp_path / "run1"
    run.mkdir()
    recs = [_rec("topk_softmax.triton", 10.0), _rec("topk_softmax.compile", 40.0, "torch.compile")]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["compare", str(run)]) == 0
    assert "vs best peer" in capsys.readouterr().out
    assert main(["compare", str(run), "--impls", "topk_softmax.compile,topk_softmax.triton"]) == 0
    out = capsys.readouterr().out
    assert "0.250" in out and "1 matching points" in out
