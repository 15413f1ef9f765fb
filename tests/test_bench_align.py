"""bench/align.py: the registered moe_align_block_size cases check out, and the oblivious twin counts its harm."""


def test_align_registration_cases(device):
    from moebench.registry import RunContext, get
    from moebench.sweep import Params

    ctx = RunContext(device=device)
    p = Params(num_tokens=48, padding_ratio=0.25, num_experts=16, top_k=6, block_size=16, hidden=64)
    infos = {}
    for variant in ("triton", "torch", "oblivious"):
        case = get(f"moe_align_block_size.{variant}").build(p, ctx)
        assert case.nvtx_stage == "align" and case.bytes_moved > 0
        res = case.check()
        assert res.ok, res.detail
        infos[variant] = case.info
    assert infos["oblivious"]["corrupted_routes"] == 12 * 6  # every slot of the 12 padded rows
    # Expert parallelism: rank 0's map, local ids, non-local routes skipped.
    case = get("moe_align_block_size.triton").build(Params(num_tokens=32, num_experts=16, top_k=4, ep_size=2,
                                                           block_size=16, hidden=64), ctx)
    assert case.info["num_local_experts"] == 8 and case.check().ok
