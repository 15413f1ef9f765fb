"""stage_rows (the gate/up GEMM's A rows in sorted order) against its reference, bit for bit."""

import pytest
import torch

from moebench.check import poison
from moebench.kernels.fp8_quant import E4M3
from moebench.kernels.moe_align_block_size import moe_align_block_size_torch
from moebench.kernels.stage_rows import stage_rows, stage_rows_torch

CASES = [  # (tokens, top_k, experts, hidden, block_m, block_p, block_h)
    (40, 4, 8, 96, 16, 16, None), (33, 2, 5, 48, 16, 8, 32), (7, 8, 16, 256, 32, 16, 64), (1, 1, 1, 16, 16, 16, None),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_stage_rows_matches_reference(device, case, dtype):
    m, k, e, h, block_m, block_p, block_h = CASES[case]
    g = torch.Generator().manual_seed(case)
    x = (torch.randn(m, h, generator=g) * 3).to(dtype).to(device)
    ids = torch.randint(-1, e + 1, (m, k), generator=g, dtype=torch.int32).to(device)  # -1 and ids >= E skipped
    sorted_ids, _, num_post = moe_align_block_size_torch(ids, e, block_m)
    n = int(num_post)
    out = poison(torch.empty(sorted_ids.numel() + 8, h, dtype=dtype, device=device))
    stage_rows(x, sorted_ids, num_post, k, out, block_p=block_p, block_h=block_h)
    ref = stage_rows_torch(x, sorted_ids, num_post, k)
    bits = torch.uint8 if dtype == E4M3 else torch.int16
    assert torch.equal(out[:n].view(bits).cpu(), ref.view(bits).cpu())
    assert torch.equal(out[n:].view(bits).cpu(), poison(torch.empty_like(out[n:])).view(bits).cpu())  # not written
    pad = sorted_ids[:n] >= m * k
    if pad.any():
        assert (ref[pad].float() == 0).all()


def test_stage_rows_rejects_a_mismatched_buffer(device):
    x = torch.randn(4, 32, device=device).to(torch.bfloat16)
    ids = torch.zeros(4, 1, dtype=torch.int32, device=device)
    sorted_ids, _, num_post = moe_align_block_size_torch(ids, 2, 16)
    with pytest.raises(ValueError, match="out: expected"):
        stage_rows(x, sorted_ids, num_post, 1, torch.empty(16, 16, dtype=torch.bfloat16, device=device))
