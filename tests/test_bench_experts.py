"""bench/experts.py: the registered fused_experts cases check out against the fp32 reference and declare their
work; the oblivious twin corrupts rows. CPU runs go through Triton's interpreter at small shapes."""


def test_registered_impls_check(device):
    from moebench.registry import RunContext, get
    from moebench.params import Params

    ctx = RunContext(device=device)
    p = Params(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=64, intermediate=32,
               padding_ratio=0.25, padding_fill="repeat")
    for name in ("fused_experts.triton", "fused_experts.torch", "fused_experts.oblivious"):
        impl = get(name)
        assert impl.available(ctx) is None
        case = impl.build(p, ctx)
        res = case.check()
        assert res.ok, (name, res.detail)
        assert res.metrics["out.frobenius_rel"] < 1e-2
        assert case.nvtx_stage == "experts" and case.flops > 0 and case.bytes_moved > 0
        if name.endswith("oblivious"):
            # non-local routes (ids 4..7 -> -1) keep their weights, so real rows are corrupted pre-fix
            assert case.info["corrupted_rows"] > 0
            assert case.info["computed_routes"] > case.info["valid_routes"]
        case.cleanup()
