"""bench/staging.py: the interpreter-tolerant fp8 comparison still catches real errors; the registered
prepare_moe_inputs cases check out and count the oblivious twin's harm."""

import torch

from moebench.bench.staging import fp8_interpreter_tolerant_mismatches


def test_tolerant_fp8_comparison_catches_real_errors():
    """The CPU comparison forgives exactly the interpreter's deviations and nothing else."""
    ref = torch.tensor([128.0, 120.0, 64.0, -256.0, 1.0, 0.5, 0.0, 448.0]).to(torch.float8_e4m3fn)
    # exact; a tie rounded up (1 ulp); exact; the lost binade carry (half); exact; 1 ulp; exact; exact
    fine = torch.tensor([128.0, 128.0, 64.0, -128.0, 1.0, 0.5625, 0.0, 448.0]).to(torch.float8_e4m3fn)
    assert not fp8_interpreter_tolerant_mismatches(fine, ref).any()
    bad = torch.tensor([96.0, 144.0, 48.0, -512.0, 2.0, 0.375, 1.0, float("nan")]).to(torch.float8_e4m3fn)
    assert fp8_interpreter_tolerant_mismatches(bad, ref).all()


def test_registered_impls_check_and_count_harm():
    from moebench.registry import RunContext, get
    from moebench.params import Params

    p = Params(num_tokens=24, padding_ratio=0.25, num_experts=16, top_k=4, hidden=512, group_size=32)
    ctx = RunContext(device=torch.device("cpu"))
    harm = {}
    for variant in ("triton", "torch", "oblivious"):
        impl = get(f"prepare_moe_inputs.{variant}")
        assert set(impl.targets) == {"kernel", "stage"} and impl.mask_aware == (variant != "oblivious")
        case = impl.build(p, ctx)
        res = case.check()
        assert res.ok, (variant, res.detail)
        assert case.nvtx_stage == "stage" and case.bytes_moved > 2 * 24 * 512
        harm[variant] = case.info["corrupted_rows"]
    assert harm == {"triton": 0, "torch": 0, "oblivious": 6}
    p_fp32 = Params(num_tokens=8, num_experts=16, top_k=6, hidden=256, group_size=128, scale_format="fp32")
    assert get("prepare_moe_inputs.triton").build(p_fp32, ctx).check().ok
    assert get("prepare_moe_inputs.triton").validate(Params(hidden=160, group_size=32)) is not None
