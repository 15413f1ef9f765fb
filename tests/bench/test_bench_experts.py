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


def test_row_tiles_count_the_partial_tiles_of_uneven_experts():
    import torch

    from moebench.bench.experts import row_tiles

    equal = row_tiles(torch.full((128,), 256))
    assert equal["128"] == {"tiles": 256, "equal_tiles": 256, "efficiency": 1.0}
    # 130 rows take two 128-row tiles, 1 row a third; split evenly over the 3 groups (44, 44, 43, as the equal
    # ceiling's groups) the 131 rows take one tile a group at either size
    uneven = row_tiles(torch.tensor([0, 130, 1]))
    assert uneven["128"] == {"tiles": 3, "equal_tiles": 3, "efficiency": round(131 / 384, 4)}
    assert uneven["64"] == {"tiles": 4, "equal_tiles": 3, "efficiency": round(131 / 256, 4)}
    assert row_tiles(torch.tensor([300, 0]))["128"] == {"tiles": 3, "equal_tiles": 4, "efficiency": round(300 / 384, 4)}
    assert row_tiles(torch.zeros(4, dtype=torch.long))["64"] == {"tiles": 0, "equal_tiles": 0, "efficiency": None}
    # paired: 300 rows = 5 blocks of 64 -> 2 full tiles + 1 half; 130 = 3 blocks -> 1 + 1; 64 = 1 block -> 1 half
    assert row_tiles(torch.tensor([300, 130, 64, 0]))["64x2"] == {
        "tiles": 6, "half_tiles": 3, "equal_tiles": 4, "efficiency": round(494 / (9 * 64), 4)}


def test_records_carry_the_row_tiles_of_their_routing(device):
    import torch

    from moebench.bench.experts import equal_rows
    from moebench.params import Params
    from moebench.registry import RunContext, get

    p = Params(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=64, intermediate=32)
    case = get("fused_experts.triton").build(p, RunContext(device=device))
    tiles = case.info["row_tiles"]["64"]
    rows = case.info["valid_routes"]
    assert tiles["equal_tiles"] == sum(-(-int(v) // 64) for v in equal_rows(rows, 4)) >= 1
    assert tiles["tiles"] >= -(-rows // 64)
    assert tiles["efficiency"] == round(case.info["valid_routes"] / (64 * tiles["tiles"]), 4)
    case.cleanup()
