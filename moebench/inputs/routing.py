"""Synthetic router logits: `uniform`, `zipf` (expert popularity ~ 1/rank^s) and `hot_expert`.

Logits are noise plus a per-expert prior. The prior only skews the *real* tokens; what padded rows route to is
decided by their content (see padding.py): identical padded rows give identical logits and so pile onto the same
experts, exactly as a gate projection without bias would.
"""

from __future__ import annotations

import math

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def expert_prior(routing: str, num_experts: int, *, zipf_exponent: float = 1.2, hot_experts: int = 1,
                 hot_ratio: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-expert additive logit bias (fp32 [E], on the CPU) realising the requested popularity skew.

    Which experts are popular is a seeded random permutation, so skew never coincides with the low-index
    tie-break of an all-equal row.
    """
    E = num_experts
    if routing == "uniform":
        return torch.zeros(E)
    perm = torch.randperm(E, generator=generator)
    prior = torch.zeros(E)
    if routing == "zipf":
        ranks = torch.arange(1, E + 1, dtype=torch.float64)
        prior[perm] = (-zipf_exponent * torch.log(ranks)).float()
        return prior
    if routing == "hot_expert":
        h = hot_experts
        if h >= E or hot_ratio <= 0.0:
            return prior
        # softmax mass on the h hot experts ~= hot_ratio  =>  exp(b) * h / (exp(b) * h + E - h) = hot_ratio
        ratio = min(hot_ratio, 1.0 - 1e-6)
        boost = math.log(ratio / (1.0 - ratio) * (E - h) / h)
        prior[perm[:h]] = boost
        return prior
    raise ValueError(f"unknown routing {routing!r}")


def real_logits(num_rows: int, prior: torch.Tensor, *, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Logits of real tokens: N(0, scale^2) noise plus the prior, cast to `dtype`."""
    noise = torch.randn(num_rows, prior.numel(), generator=generator, device=device, dtype=torch.float32)
    return (noise * scale + prior.to(device)).to(dtype)
