"""Seeded expert weights: w13 [E, 2I, H] and w2 [E, H, I], a pure function of (E, H, I, seed, device)."""

from __future__ import annotations

import torch

__all__ = ["make_expert_weights", "cached_expert_weights"]


def make_expert_weights(num_experts: int, hidden: int, intermediate: int, *, seed: int,
                        device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded w13 [E, 2I, H] ~ N(0, 1/H) and w2 [E, H, I] ~ N(0, 1/I), generated one expert at a time (small fp32
    temporaries even for 128 x 88 MB of weights)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 7_777_777 + 12345)
    w13 = torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device)
    w2 = torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device)
    for e in range(num_experts):
        w13[e] = torch.randn(2 * intermediate, hidden, generator=g, device=device) * hidden ** -0.5
        w2[e] = torch.randn(hidden, intermediate, generator=g, device=device) * intermediate ** -0.5
    return w13, w2


# Consecutive points of a sweep share one copy (generating 256 x 88 MB of weights takes longer than timing a
# point). One entry: a new key frees the old one.
_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def cached_expert_weights(num_experts: int, hidden: int, intermediate: int, seed: int, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """make_expert_weights, reusing the previous call's tensors when the key is the same."""
    key = (num_experts, hidden, intermediate, seed, str(device))
    if key not in _CACHE:
        _CACHE.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _CACHE[key] = make_expert_weights(num_experts, hidden, intermediate, seed=seed, device=device)
    return _CACHE[key]
