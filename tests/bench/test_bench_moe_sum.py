"""bench/moe_sum.py: the registered masked_moe_sum cases check out and the oblivious twin counts its harm."""


def test_registration_cases(device):
    from moebench.registry import RunContext, get
    from moebench.params import Params

    ctx = RunContext(device=device)
    p = Params(num_tokens=16, padding_ratio=0.5, num_experts=16, top_k=6, hidden=256)
    cases = {}
    for variant in ("triton", "torch", "oblivious"):
        case = get(f"masked_moe_sum.{variant}").build(p, ctx)
        assert case.nvtx_stage == "reduce"
        res = case.check()
        assert res.ok, res.detail
        cases[variant] = case
    assert cases["oblivious"].info["corrupted_rows"] == 8  # the 8 padded rows
    # Masked: only the real rows' slots are read; oblivious reads all of them.
    elt_row = 256 * 2
    assert cases["oblivious"].bytes_moved - cases["triton"].bytes_moved == 8 * 6 * elt_row
    assert cases["triton"].bytes_moved == (8 * 6 + 16) * elt_row + 16 * 6 * 4
