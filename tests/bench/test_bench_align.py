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


def test_align_config_parameter_selects_each_candidate(device):
    """`config` picks each ALIGN_CANDIDATES entry for .triton (no candidate impls any more); each case checks out
    and records the launch it took, explicitly; without one the record says the rule ran (no table on the CPU),
    and sweeps/tune_align.yaml tunes .triton alone."""
    import dataclasses
    from pathlib import Path

    import yaml

    from moebench.kernels.moe_align_block_size import ALIGN_CANDIDATES, DEFAULT_ALIGN_CONFIG
    from moebench.params import Params
    from moebench.registry import RunContext, all_impls, get

    sweep = yaml.safe_load((Path(__file__).resolve().parents[2] / "sweeps" / "tune_align.yaml").read_text())
    assert sweep["impls"] == ["moe_align_block_size.triton"]
    assert not [n for n in all_impls() if n.startswith("moe_align_block_size.triton_")]
    ctx = RunContext(device=device)
    p = Params(num_tokens=40, padding_ratio=0.25, num_experts=16, top_k=6, ep_size=2, block_size=16, hidden=64)
    for name in ALIGN_CANDIDATES:
        case = get("moe_align_block_size.triton").build(dataclasses.replace(p, config=name), ctx)
        res = case.check()
        assert res.ok, (name, res.detail)
        assert (case.info["config"], case.info["config_source"], case.info["config_bucket"]) == \
            (name, "explicit", "R=256,E=8")
    info = get("moe_align_block_size.triton").build(p, ctx).info
    assert (info["config"], info["config_source"], info["config_gpu"]) == (DEFAULT_ALIGN_CONFIG, "rule", "cpu")
