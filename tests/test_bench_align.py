"""bench/align.py: the registered moe_align_block_size cases check out, and the oblivious twin counts its harm."""


def test_align_registration_cases(device):
    from moebench.registry import RunContext, get
    from moebench.params import Params

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


def test_align_candidate_impls_registered_and_swept(device):
    """Every non-default ALIGN_CANDIDATES entry is a registered impl whose case checks out, and
    sweeps/tune_align.yaml times all of them beside .triton."""
    from pathlib import Path

    import yaml

    from moebench.kernels.moe_align_block_size import ALIGN_CANDIDATES, DEFAULT_ALIGN_CONFIG
    from moebench.registry import RunContext, get
    from moebench.params import Params

    names = [f"moe_align_block_size.triton_{n}" for n in ALIGN_CANDIDATES if n != DEFAULT_ALIGN_CONFIG]
    assert names
    sweep = yaml.safe_load((Path(__file__).parents[1] / "sweeps" / "tune_align.yaml").read_text())
    assert sweep["impls"] == ["moe_align_block_size.triton", *names]
    ctx = RunContext(device=device)
    p = Params(num_tokens=40, padding_ratio=0.25, num_experts=16, top_k=6, ep_size=2, block_size=16, hidden=64)
    for name in names:
        impl = get(name)
        assert "tuning candidate" in impl.description
        case = impl.build(p, ctx)
        res = case.check()
        assert res.ok, (name, res.detail)
        assert case.info["num_local_experts"] == 8
