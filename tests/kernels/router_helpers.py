"""Inputs and the reference comparison shared by the router kernel tests (test_topk_softmax, test_grouped_topk)."""

from __future__ import annotations

import torch

from moebench.bench.routers import RouterReference, compare_routing
from moebench.check import poison

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_logits(num_tokens, num_experts, dtype, seed, device, scale=2.0):
    return (torch.randn(num_tokens, num_experts, generator=seeded(seed)) * scale).to(dtype).to(device)


def make_bias(num_experts, seed, device):
    return ((torch.rand(num_experts, generator=seeded(seed + 1)) - 0.5) * 0.2).to(device)


def make_mask(num_tokens, ratio, seed, device):
    return (torch.rand(num_tokens, generator=seeded(seed + 2)) < ratio).to(device)


def poisoned_out(num_tokens, top_k, device):
    out = (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
           torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))
    for t in out:
        poison(t)
    return out


def assert_same_as_reference(weights, ids, ref: RouterReference):
    """ids bit for bit (random CPU inputs have no near-ties), weights within 1e-5, padded rows exactly -1 / +0.0."""
    res = compare_routing(weights, ids, ref)
    assert res.ok, res.detail
    assert torch.equal(ids.cpu(), ref.ids.cpu()), "ids differ from the reference"
    assert res.metrics["ids.near_tie_rows"] == 0
    assert res.metrics["weights.max_rel"] <= 1e-5


def crafted_tie_logits(num_experts: int, device) -> torch.Tensor:
    """Rows built to tie: all equal, a tied top block, +0.0 / -0.0 logits, ties that only appear after the bias
    (see tie_bias), and blocks of equal values at both ends of the row."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, num_experts, generator=g)
    logits[0] = 0.25
    logits[1, ::3] = 3.0
    logits[2] = torch.where(torch.arange(num_experts) % 2 == 0, torch.tensor(0.0), torch.tensor(-0.0))
    logits[3, :] = 1.0
    logits[3, num_experts // 2:] = 1.5  # a tie block in the upper half, the lower half tied below it
    logits[4, -7:] = 5.0  # the top block at the end of the row (and inside the padded tail's slice)
    logits[5] = torch.arange(num_experts, dtype=torch.float32) % 5  # five-valued row: wide tie groups
    logits[6] = 0.0
    logits[7] = torch.arange(num_experts, dtype=torch.float32).flip(0) * 1e-3
    return logits.to(device)


def tie_bias(num_experts: int, device) -> torch.Tensor:
    # row 6 (all p equal) + this bias: experts 1 and 4 (and every 7th from 2) tie after the bias
    bias = torch.zeros(num_experts)
    bias[[1, 4]] = 0.5
    bias[2::7] = 0.25
    return bias.to(device)
