"""peers/matmul_ogs.py: triton_kernels' matmul_ogs as an experts peer, against the stand-in written from
triton_kernels' sources (tests/standins/triton_kernels_standin.py): the reference check at small points (one past
32 experts: bitmatrix words past the first), the bitmatrix and routing metadata, -1 as its sentinel, the SwiGLU run as
silu(gate) * up, the skip reason of a triton_kernels of another API generation."""

from __future__ import annotations


import pytest
import torch

from moebench import registry
from moebench.peers import matmul_ogs as peers_matmul_ogs
from tests.peers.peer_checks import CPU, bound, checked as _check, params as _params
from tests.standins import triton_kernels_standin

SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=64, intermediate=32, padding_ratio=0.25)
POINTS = {"small": SMALL, "experts40": dict(SMALL, num_experts=40, top_k=4),
          "ep_rank": dict(SMALL, num_experts=16, num_local_experts=8, top_k=4)}


@pytest.fixture(name="standins")
def bound_triton_kernels():
    with bound(peers_matmul_ogs.TRITON_KERNELS, triton_kernels_standin):
        yield




def test_every_triton_kernels_peer_is_checked_here():
    peers = [n for n, i in registry.all_impls().items() if i.library == "triton_kernels"]
    assert peers == ["fused_experts.triton_kernels"]


@pytest.mark.parametrize("label", sorted(POINTS))
def test_matmul_ogs_passes_the_reference_check_against_its_standin(standins, label):
    case, res = _check("fused_experts.triton_kernels", _params(**POINTS[label]))
    assert res.ok, res.detail
    assert case.info["skipped_routes"] > 0  # padded (and non-local) routes went in as -1
    assert case.info["adapter_status"].startswith("stand-in for triton_kernels")
    assert case.info["matmul_ogs_generation"] == "v3.6.0"
    case.run()  # what is timed runs again on the same buffers


def test_matmul_ogs_bitmatrix_holds_each_rows_valid_ids():
    ids = torch.tensor([[0, 31, -1], [63, 32, 5], [-1, -1, -1]], dtype=torch.int32)
    packed = peers_matmul_ogs.pack_bitmatrix(ids, 64)
    assert packed.dtype == torch.uint32 and packed.shape == (3, 2)
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert words.tolist() == [[1 | 1 << 31, 0], [1 << 5, 1 << 31 | 1]] + [[0, 0]]
    mask = triton_kernels_standin.Bitmatrix(packed, dtype=triton_kernels_standin.BIT, shape=[3, 64])
    meta = triton_kernels_standin.make_bitmatrix_metadata(ids.to(torch.int16), mask)
    assert meta.row_sorted_indx.tolist() == [0, 2, -1, 4, 3, 1, -1, -1, -1]  # by expert; -1: the sentinel
    with pytest.raises(ValueError, match="bitmatrix"):  # a bit the ids do not list: the real kernel overruns
        triton_kernels_standin.make_bitmatrix_metadata(torch.where(ids == 5, -1, ids).to(torch.int16), mask)


def test_matmul_ogs_runs_openai_swiglu_as_silu_times_up(standins, monkeypatch):
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(6, 2, 8, generator=g)  # [rows, (gate, up), I] -> interleaved columns, up shifted by -1
    interleaved = torch.stack([gate_up[:, 0], gate_up[:, 1] - 1.0], dim=2).reshape(6, 16)
    got = triton_kernels_standin.swiglu_fn(interleaved, 1.0, peers_matmul_ogs.NO_CLIP)
    want = torch.nn.functional.silu(gate_up[:, 0]) * gate_up[:, 1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    case, res = _check("fused_experts.triton_kernels", _params(**SMALL))
    assert res.ok and "-1 bias" in case.info["matmul_ogs_swiglu"] and "sentinel" in case.info[
        "matmul_ogs_skipped_routes"]
    # without the bias, triton_kernels' SwiGLU is s * (up + 1): the check catches it
    monkeypatch.setattr(peers_matmul_ogs, "linear_bias", lambda e, i, device: torch.zeros(e, 2 * i))
    _, res = _check("fused_experts.triton_kernels", _params(**SMALL))
    assert not res.ok


@pytest.mark.parametrize("label", sorted(POINTS))
def test_matmul_ogs_of_the_v351_generation_passes_the_reference_check(label):
    """The generation vLLM 0.33.0 bundles: routing metadata from routing_from_bitmatrix, a Bitmatrix without dtype."""
    with bound(peers_matmul_ogs.TRITON_KERNELS, triton_kernels_standin.legacy()):
        case, res = _check("fused_experts.triton_kernels", _params(**POINTS[label]))
    assert res.ok, res.detail
    assert case.info["matmul_ogs_generation"] == "v3.5.1" and case.info["skipped_routes"] > 0


def test_a_triton_kernels_without_the_v36_api_says_why():
    def load():
        raise ImportError("cannot import name 'SparseMatrix' from 'triton_kernels.tensor'")

    lib = peers_matmul_ogs.Library("triton_kernels", "torch", load)
    assert "does not import here (ImportError: cannot import name 'SparseMatrix'" in lib.available(CPU, "matmul_ogs")
    assert "not installed" in peers_matmul_ogs.Library("triton_kernels", "moebench_no_such_module", load).available(
        CPU, "matmul_ogs")
