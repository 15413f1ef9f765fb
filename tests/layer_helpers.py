"""What the layer tests share (tests/bench/test_bench_layer.py, tests/bench/test_bench_layer_fp8.py): building a registered impl
at a point, the relative Frobenius error, what the oblivious layer does to padded rows, and the GPU check of the
masked and oblivious layers at one shape."""

from __future__ import annotations

import torch

from moebench.bench import layer as layer_mod
from moebench.inputs import make_batch
from moebench.params import Params
from moebench.registry import RunContext, get


def build_case(impl: str, p: Params, device):
    return get(impl).build(p, RunContext(device=torch.device(device)))


def frob(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def assert_oblivious_computes_padded_rows(p: Params, masked, oblivious, out_m, out_o, pad) -> None:
    """The oblivious layer (output out_o) computed every padded row as a real one: non-zero output, all its routes
    misrouted, more work declared than the masked layer (out_m); the real rows are the masked layer's (the two
    reductions may round differently: the pre-fix plain sum is torch's, the masked one Triton's)."""
    assert (out_o[pad] != 0).any(dim=1).all()
    assert not layer_mod.rows_differing(out_o[~pad], out_m[~pad]).any()
    info = oblivious.info
    assert info["corrupted_rows"] == int(pad.sum()) == info["corrupted_padded_rows"]
    assert info["misrouted_routes"] == int(pad.sum()) * p.top_k
    assert oblivious.flops > masked.flops


def assert_layers_replay_and_agree(p: Params, max_frobenius_rel: float | None = None) -> None:
    """On the GPU: layer.masked and layer.oblivious at `p` pass their checks (and, given max_frobenius_rel, the
    check's out.frobenius_rel is below it); the layer and every stage replay from a CUDA graph with the eager result;
    masked padded rows are 0 and both agree bitwise on the real rows."""
    from moebench.measure.timing import measure
    from moebench.params import Timing

    outs = {}
    for impl in ("layer.masked", "layer.oblivious"):
        case = build_case(impl, p, "cuda")
        res = case.check()
        assert res.ok, (impl, res.detail)
        if max_frobenius_rel is not None:
            assert res.metrics["out.frobenius_rel"] < max_frobenius_rel
        eager = case.run().clone()
        measure(case.run, Timing(mode="cuda_graph", warmup=1, iters=2), torch.device("cuda"))
        for _, fn in case.stages:
            measure(fn, Timing(mode="cuda_graph", warmup=1, iters=2), torch.device("cuda"))
        again = case.run()
        torch.cuda.synchronize()
        assert torch.equal(eager, again)
        outs[impl] = eager
        case.cleanup()
    pad = make_batch(p, "cpu").is_padding.cuda()
    assert (outs["layer.masked"][pad] == 0).all()
    assert torch.equal(outs["layer.masked"][~pad], outs["layer.oblivious"][~pad])
