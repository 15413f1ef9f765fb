"""Token imbalance across experts and EP ranks, computed exactly from the routing actually produced.

Counts are of *routes*: one (token, slot) pair with a valid expert id. A route with id -1 ("no expert", e.g. a
masked padding row) counts nowhere. Routes of rows whose `is_padding` is True but that were still routed (an
unmasked or mask-oblivious router) are *padding routes*; all others are real routes.

Rank r of R owns experts [r*E/R, (r+1)*E/R) (docs/contracts.md#ep-layout). A rank's load is the number of routes to its experts:
the expert work it does. `per_rank_tokens_*` additionally count distinct (token, rank) pairs: the rows a
dispatch moves to that rank (each pair at most once).

Figures over a load vector x of n entries (experts or ranks), with mean = sum(x)/n:
  max_over_mean  max(x) / mean (MaxVio + 1)            balancedness  mean / max(x)
  cv             population std(x) / mean              hottest / slowest_rank  first index of max(x)
  hottest_share  max(x) / sum(x)                       slowest_excess  max(x) - mean (routes)
  slowest_excess_ratio  (max(x) - mean) / mean: how much longer the slowest rank works than a balanced one.
With zero routes every figure is 0 except balancedness (1.0: nothing is imbalanced), hottest/slowest_rank 0.
Per-rank loads are a function of the routing only, so they are exact for any R, including EP sizes simulated
on fewer devices.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moebench.kernels.contract import check_mask
from moebench.params import EPLayout


def _check_routing(topk_ids: torch.Tensor, layout: EPLayout) -> torch.Tensor:
    """Validate and return the ids as int64 [T, K]."""
    num_experts = layout.num_experts
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    ids = topk_ids.long()
    bad = ((ids < -1) | (ids >= num_experts)).sum().item() if ids.numel() else 0
    if bad:
        raise ValueError(f"topk_ids has {bad} ids outside [-1, {num_experts}): not a routing over {num_experts} "
                         f"experts")
    return ids


def _expert_counts(ids: torch.Tensor, routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(ids[routes], minlength=num_experts)


def per_rank_loads(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """Routes to each EP rank's experts (int64 [ep_size], on topk_ids' device); ids -1 count nowhere.

    For simulated EP: rank r's expert work is loads[r], whatever devices actually ran the layer.
    """
    layout = EPLayout(0, ep_size, num_experts)
    ids = _check_routing(topk_ids, layout)
    counts = _expert_counts(ids, ids >= 0, num_experts)
    return counts.view(ep_size, layout.local_experts).sum(dim=1)


def rank_rows(topk_ids: torch.Tensor, layout: EPLayout) -> list[int]:
    """Rows with at least one route to each EP rank's experts: the rows a token dispatch sends each rank."""
    ids = _check_routing(topk_ids, layout)
    return _rank_tokens(ids, torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device), layout)


def _rank_tokens(ids: torch.Tensor, rows: torch.Tensor, layout: EPLayout) -> list[int]:
    """Distinct (token, rank) pairs among the selected rows: the rows a dispatch sends to each rank."""
    num_tokens, ep_size = ids.shape[0], layout.ep_size
    if num_tokens == 0 or ids.shape[1] == 0:
        return [0] * ep_size
    valid = (ids >= 0) & rows.unsqueeze(1)
    # -1 slots go to a spare column ep_size that is dropped afterwards.
    rank_of = torch.where(valid, ids.clamp(min=0) // layout.local_experts, torch.full_like(ids, ep_size))
    hits = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=ids.device)
    hits.scatter_(1, rank_of, True)
    return [int(v) for v in hits[:, :ep_size].sum(dim=0).tolist()]


def _spread(loads: list[int]) -> tuple[float, float, float, float, int]:
    """(mean, max_over_mean, balancedness, cv, first argmax) of a load vector; the zero-route convention."""
    n = len(loads)
    total = sum(loads)
    top = max(loads)
    first_max = loads.index(top)
    if total == 0:
        return 0.0, 0.0, 1.0, 0.0, 0
    mean = total / n
    std = math.sqrt(sum((x - mean) ** 2 for x in loads) / n)
    return mean, top / mean, mean / top, std / mean, first_max


def expert_figures(per_expert: list[int]) -> dict[str, Any]:
    _, max_over_mean, balancedness, cv, hottest = _spread(per_expert)
    total = sum(per_expert)
    return {"max_over_mean": max_over_mean, "balancedness": balancedness, "cv": cv, "hottest": hottest,
            "hottest_share": per_expert[hottest] / total if total else 0.0}


def rank_figures(per_rank: list[int]) -> dict[str, Any]:
    mean, max_over_mean, balancedness, cv, slowest = _spread(per_rank)
    excess = per_rank[slowest] - mean
    return {"max_over_mean": max_over_mean, "balancedness": balancedness, "cv": cv, "slowest_rank": slowest,
            "slowest_load": int(per_rank[slowest]), "mean_load": mean, "slowest_excess": excess,
            "slowest_excess_ratio": excess / mean if mean else 0.0}


def imbalance(topk_ids: torch.Tensor, is_padding: torch.Tensor | None, num_experts: int,
              ep_size: int = 1) -> dict[str, Any]:
    """Per-expert and per-rank loads of a routing, split into real and padding routes, plus their figures.

    topk_ids [T, K] global expert ids (-1 = none); is_padding [T] bool or None (no padding rows). Works on CPU or
    CUDA tensors and returns plain Python numbers (JSON-able). See the module docstring for the definitions.
    """
    layout = EPLayout(0, ep_size, num_experts)
    ids = _check_routing(topk_ids, layout)
    num_tokens = ids.shape[0]
    check_mask(is_padding, num_tokens)
    pad_rows = is_padding.to(device=ids.device, dtype=torch.bool) if is_padding is not None else \
        torch.zeros(num_tokens, dtype=torch.bool, device=ids.device)
    valid = ids >= 0
    pad_routes = valid & pad_rows.unsqueeze(1)
    real_routes = valid & ~pad_rows.unsqueeze(1)
    per_expert_real = [int(v) for v in _expert_counts(ids, real_routes, num_experts).tolist()]
    per_expert_padding = [int(v) for v in _expert_counts(ids, pad_routes, num_experts).tolist()]
    per_expert_all = [a + b for a, b in zip(per_expert_real, per_expert_padding)]

    def by_rank(per_expert: list[int]) -> list[int]:
        first = layout.first_expert
        return [sum(per_expert[first(r):first(r + 1)]) for r in range(ep_size)]

    per_rank_real = by_rank(per_expert_real)
    per_rank_padding = by_rank(per_expert_padding)
    per_rank_all = [a + b for a, b in zip(per_rank_real, per_rank_padding)]
    return {
        "num_experts": num_experts,
        "ep_size": ep_size,
        "num_tokens": num_tokens,
        "num_padding_tokens": int(pad_rows.sum().item()),
        "per_expert_real": per_expert_real,
        "per_expert_padding": per_expert_padding,
        "per_rank_real": per_rank_real,
        "per_rank_padding": per_rank_padding,
        "per_rank_tokens_real": _rank_tokens(ids, ~pad_rows, layout),
        "per_rank_tokens_padding": _rank_tokens(ids, pad_rows, layout),
        "num_routes": sum(per_expert_all),
        "num_padding_routes": sum(per_expert_padding),
        "expert": expert_figures(per_expert_all),
        "rank": rank_figures(per_rank_all),
        "real_only": {"expert": expert_figures(per_expert_real), "rank": rank_figures(per_rank_real)},
    }
