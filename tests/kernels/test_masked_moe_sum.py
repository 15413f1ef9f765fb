"""masked_moe_sum: Triton kernel vs the torch reference; NaN in skipped slots must never reach the output."""

import functools

import pytest
import torch

from moebench.check import poison
from moebench.kernels.masked_moe_sum import (SUM_CANDIDATES, SumLaunch, launch_masked_sum, masked_moe_sum,
                                             masked_moe_sum_torch, moe_sum_oblivious, sum_choice, sum_launch_config)


def make_inputs(num_tokens, top_k, hidden, *, seed, dtype=torch.bfloat16, skip_prob=0.3, padded_rows=0,
                ids_dtype=torch.int32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (num_tokens, top_k), generator=g)
    ids[torch.rand(ids.shape, generator=g) < skip_prob] = -1
    if padded_rows:
        ids[num_tokens - padded_rows:] = -1
    x = torch.randn(num_tokens, top_k, hidden, generator=g).to(dtype)
    x[ids < 0] = float("nan")  # loading a skipped slot would poison the row
    return x.to(device), ids.to(ids_dtype).to(device)


def sequential_fp32_sum(x, ids):
    """fp32 sum over the valid slots in order k = 0..K-1, written independently of the module's reference."""
    acc = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32)
    xc, idc = x.cpu().float(), ids.cpu()
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            if idc[m, k] >= 0:
                acc[m] += xc[m, k]
    return acc


def bf16_ulp(v):
    """One bf16 ulp at |v| (the spacing of bf16 numbers there)."""
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**-126)))
    return torch.pow(2.0, exp - 7)


def run_poisoned(x, ids):
    out = poison(torch.empty(x.shape[0], x.shape[2], dtype=x.dtype, device=x.device))
    return masked_moe_sum(x, ids, out=out)


@pytest.mark.parametrize("top_k,hidden", [(1, 40), (2, 256), (6, 1500), (8, 1024)])
def test_fp32_bitwise_vs_reference(top_k, hidden, device):
    x, ids = make_inputs(13, top_k, hidden, seed=top_k, dtype=torch.float32, padded_rows=3, device=device)
    got = run_poisoned(x, ids)
    want = sequential_fp32_sum(x, ids)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.equal(masked_moe_sum_torch(x, ids).cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("top_k,hidden,ids_dtype", [(6, 1500, torch.int32), (8, 2048, torch.int64), (3, 7, torch.int32)])
def test_bf16_nan_slots_never_reach_output(top_k, hidden, ids_dtype, device):
    x, ids = make_inputs(11, top_k, hidden, seed=10 + top_k, padded_rows=2, ids_dtype=ids_dtype, device=device)
    got = run_poisoned(x, ids).cpu()
    assert torch.isfinite(got).all()
    acc = sequential_fp32_sum(x, ids)
    # Rounded once (to nearest even) from the same fp32 sum: bit for bit with the reference. (Under the CPU
    # interpreter, whose own fp32 -> bf16 cast truncates, the kernel rounds on the bit pattern.)
    err = (got.float() - acc).abs()
    assert (err <= bf16_ulp(acc)).all(), err.max()
    ref = masked_moe_sum_torch(x, ids).cpu()
    assert torch.equal(ref, acc.to(torch.bfloat16))
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("launch", [SumLaunch(1, 1024, 4), SumLaunch(2, 64, 1), SumLaunch(4, 32, 1),
                                    SumLaunch(2, 2048, 8), SumLaunch(2, 64, 1, "none"), SumLaunch(1, 32, 1, "cg")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_shapes_bitwise(launch, dtype, device):
    """Every launch shape gives the reference's bits: odd row counts (a half-filled last row block), columns not
    a multiple of the block, padded row pairs next to real ones, rows with one real row and one padded row."""
    x, ids = make_inputs(15, 6, 100, seed=20 + launch.rows, dtype=dtype, skip_prob=0.4, device=device)
    ids[[2, 3, 6, 9, 14]] = -1  # rows 2-3: a padded pair; 6, 9: padded next to a real row; 14: the odd last row
    got = poison(torch.empty(15, 100, dtype=dtype, device=device))
    masked_moe_sum(x, ids, out=got, config=launch)
    want = masked_moe_sum_torch(x, ids)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.cpu().view(bits), want.cpu().view(bits))
    assert torch.equal(got[[2, 3, 6, 9, 14]].cpu().view(bits), torch.zeros(5, 100, dtype=bits))


def test_default_launch_by_top_k():
    """The H200-tuned default: one row x 512 columns on one warp, no hint; top_k 1 keeps the first launch (2 rows
    x 1024 columns, 4 warps, evict-first); wider blocks get a warp per 512 columns; narrow rows a narrow block."""
    assert sum_launch_config(7168) == SumLaunch(1, 512, 1, "none")
    assert sum_launch_config(7168, top_k=1) == SumLaunch(2, 1024, 4, "evict_first")
    assert sum_launch_config(7168, 1024) == SumLaunch(1, 1024, 2, "none")
    assert sum_launch_config(100) == SumLaunch(1, 128, 1, "none")
    assert sum_launch_config(100, top_k=1) == SumLaunch(2, 128, 1, "evict_first")


def test_launch_rejects_unknown_load_hint():
    with pytest.raises(ValueError, match="load_hint"):
        SumLaunch(1, 1024, 4, "streaming")


def test_upper_bound_skips_high_ids(device):
    """launch_masked_sum with num_experts (fused_experts' slot sum): ids >= num_experts are skipped like -1, and
    the intermediate may be a flat [M*K, H] buffer with a row stride wider than H."""
    M, K, H, E = 9, 5, 48, 6
    g = torch.Generator().manual_seed(31)
    ids = torch.randint(-1, E + 3, (M, K), generator=g, dtype=torch.int32)
    ids[4] = torch.tensor([E, E + 1, -1, E + 2, E])  # a row with no valid slot at all
    flat = torch.randn(M * K, H + 16, generator=g)
    skipped = ((ids < 0) | (ids >= E)).reshape(-1)
    flat[skipped] = float("nan")
    want = masked_moe_sum_torch(flat[:, :H].reshape(M, K, H), torch.where(ids >= E, -1, ids))
    flat = flat.to(device)
    out = poison(torch.empty(M, H, device=device))
    launch_masked_sum(flat[:, :H], (K * flat.stride(0), flat.stride(0)), ids.to(device), out, num_experts=E,
                      launch=SumLaunch(2, 32, 1))
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))
    assert (out[4] == 0).all()


def test_all_skipped_rows_are_zero(device):
    x, ids = make_inputs(9, 8, 300, seed=3, padded_rows=4, device=device)
    ids[0] = -1
    got = run_poisoned(x, ids).cpu()
    for row in (0, 5, 6, 7, 8):
        assert torch.equal(got[row].view(torch.int16), torch.zeros(300, dtype=torch.int16)), row  # +0.0 exactly
    assert torch.equal(masked_moe_sum_torch(x, ids).cpu()[[0, 5, 6, 7, 8]].view(torch.int16),
                       torch.zeros(5, 300, dtype=torch.int16))


def test_no_skipped_slots_equals_plain_sum(device):
    x, ids = make_inputs(10, 8, 520, seed=4, skip_prob=0.0, device=device)
    x32, _ = make_inputs(10, 8, 520, seed=4, skip_prob=0.0, dtype=torch.float32, device=device)
    # fp32: same order, bit for bit with a sequential sum over all slots.
    seq = x32[:, 0].clone()
    for k in range(1, 8):
        seq += x32[:, k]
    assert torch.equal(run_poisoned(x32, ids).view(torch.int32), seq.view(torch.int32))
    # bf16: what torch's sum(dim=1) gives, up to one rounding.
    plain = x.sum(dim=1).float().cpu()
    got = run_poisoned(x, ids).float().cpu()
    assert ((got - plain).abs() <= bf16_ulp(plain)).all()


def test_strided_intermediate(device):
    x, ids = make_inputs(7, 6, 136, seed=5, padded_rows=1, dtype=torch.float32, device=device)
    wide = torch.full((7, 6, 150), float("nan"), device=device)
    wide[:, :, :136] = x
    view = wide[:, :, :136]  # row strides of a wider buffer; the columns past 136 are NaN and must stay unread
    got = run_poisoned(view, ids)
    assert torch.equal(got.cpu().view(torch.int32), sequential_fp32_sum(x, ids).view(torch.int32))


def test_oblivious_twin_spreads_nan(device):
    x, ids = make_inputs(8, 6, 64, seed=6, padded_rows=2, device=device)
    bad_rows = (ids < 0).any(dim=1).cpu()
    got = moe_sum_oblivious(x).cpu()
    assert torch.isnan(got[bad_rows]).any(dim=1).all()
    assert torch.isfinite(got[~bad_rows]).all()
    assert torch.isfinite(run_poisoned(x, ids)).all()


def test_rejects_bad_shapes(device):
    x, ids = make_inputs(4, 2, 16, seed=7, device=device)
    with pytest.raises(ValueError):
        masked_moe_sum(x, ids[:, :1])
    with pytest.raises(ValueError):
        masked_moe_sum(x[0], ids)
    with pytest.raises(TypeError):
        masked_moe_sum(x, ids.float())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(512, 8, 7168), (1000, 6, 4096), (64, 8, 2880)])
def test_gpu_bf16_bitwise(num_tokens, top_k, hidden):
    x, ids = make_inputs(num_tokens, top_k, hidden, seed=num_tokens, padded_rows=num_tokens // 2, device="cuda")
    got = run_poisoned(x, ids)
    want = masked_moe_sum_torch(x, ids)
    assert torch.isfinite(got).all()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SUM_CANDIDATES))
def test_gpu_candidates_bitwise(name):
    """Every tuning candidate gives the reference's bits at the tuned shape's width (H=7168, top-8, padded rows)."""
    x, ids, want = _gpu_candidate_case()
    got = poison(torch.empty(300, 7168, dtype=x.dtype, device="cuda"))
    masked_moe_sum(x, ids, out=got, config=name)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@functools.lru_cache(maxsize=None)
def _gpu_candidate_case():
    """The candidates' inputs and reference, made once (no launch writes them)."""
    x, ids = make_inputs(300, 8, 7168, seed=7, padded_rows=75, device="cuda")
    return x, ids, masked_moe_sum_torch(x, ids)


@pytest.mark.parametrize("name", sorted(SUM_CANDIDATES))
def test_candidates_bitwise(name, device):
    """Every candidate of the table, by name, gives the reference's bits (odd rows, columns not a multiple of the
    block, padded rows); the table's names are the launches' own."""
    assert SUM_CANDIDATES[name].name == name
    x, ids = make_inputs(7, 4, 72, seed=len(name), skip_prob=0.3, padded_rows=2, device=device)
    got = poison(torch.empty(7, 72, dtype=x.dtype, device=device))
    masked_moe_sum(x, ids, out=got, config=name)
    assert torch.equal(got.cpu().view(torch.int16), masked_moe_sum_torch(x, ids).cpu().view(torch.int16))


def test_choice_names_the_rule_and_refuses_unknown_names():
    """Without a table entry the rule's launch (sum_launch_config) runs, named like a candidate; an explicit name
    wins; an unknown one is a one-line error naming the table."""
    choice = sum_choice(8192, 8, 7168, "cpu")
    assert (choice.source, choice.name, choice.config) == ("rule", "r1_h512_w1_none", sum_launch_config(7168))
    assert choice.bucket == "T=8192,K=8,H=7168" and sum_choice(5000, 8, 7168, "cpu").bucket == choice.bucket
    explicit = sum_choice(8192, 8, 7168, "cpu", "r2_h1024_w4_cg")
    assert (explicit.source, explicit.config) == ("explicit", SUM_CANDIDATES["r2_h1024_w4_cg"])
    with pytest.raises(ValueError, match="'r9' is not a masked_moe_sum config \\(one of r1_h512_w1_none"):
        sum_choice(8, 8, 64, "cpu", "r9")
