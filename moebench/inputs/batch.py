"""Seeded, reproducible inputs for one point: padded hidden states, router logits, the mask and the routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.inputs.padding import fill_rows
from moebench.inputs.router_mask import point_masks
from moebench.inputs.routing import DTYPES, expert_prior, real_logits
from moebench.kernels.grouped_topk import grouped_topk_torch
from moebench.kernels.topk_softmax import topk_softmax_torch
from moebench.params import Params


@dataclass
class Batch:
    is_padding: torch.Tensor  # [T] bool, which rows are padding (always known to the benchmark)
    logits: torch.Tensor  # [T, E] in p.dtype
    hidden: torch.Tensor | None  # [T, H] bf16, or None when not asked for
    bias: torch.Tensor | None  # [E] fp32 selection bias when p.bias
    mask: torch.Tensor | None  # what a mask-aware impl is given: is_padding when p.mask, else None

    @property
    def num_tokens(self) -> int:
        return self.is_padding.shape[0]


def generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def make_batch(p: Params, device: torch.device | str, *, need_hidden: bool = True, seed_offset: int = 0) -> Batch:
    device = torch.device(device)
    seed = p.seed * 1_000_003 + seed_offset
    g = generator(seed, device)
    g_stale = generator(seed + 7919, device)  # "previous batch" for the stale fill
    prior = expert_prior(p.routing, p.num_experts, zipf_exponent=p.zipf_exponent, hot_experts=p.hot_experts,
                         hot_ratio=p.hot_ratio, generator=generator(p.seed, "cpu"))
    is_padding, mask = point_masks(p, device)  # padding.run_producer documents which rank's mask
    T = is_padding.shape[0]
    dtype = DTYPES[p.dtype]

    logits = real_logits(T, prior, dtype=torch.float32, device=device, generator=g)
    stale_logits = real_logits(T, prior, dtype=torch.float32, device=device, generator=g_stale) \
        if p.padding_fill == "stale" else None
    fill_rows(logits, is_padding, p.padding_fill, generator=g, stale=stale_logits)
    logits = logits.to(dtype)

    hidden = None
    if need_hidden:
        hidden = torch.randn(T, p.hidden, generator=g, device=device, dtype=torch.float32)
        stale_hidden = torch.randn(T, p.hidden, generator=g_stale, device=device, dtype=torch.float32) \
            if p.padding_fill == "stale" else None
        fill_rows(hidden, is_padding, p.padding_fill, generator=g, stale=stale_hidden)
        hidden = hidden.to(torch.bfloat16)

    bias = None
    if p.bias:
        bias = (torch.rand(p.num_experts, generator=g, device=device, dtype=torch.float32) - 0.5) * 0.1
    return Batch(is_padding=is_padding, logits=logits, hidden=hidden, bias=bias, mask=mask)


def route(p: Params, batch: Batch, *, use_mask: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing of a batch: (topk_weights fp32 [T,K], topk_ids int32 [T,K]).

    Uses grouped_topk when p.num_expert_group > 1, else topk_softmax; given batch.mask (or, with `use_mask`,
    is_padding / nothing).
    """
    # batch.mask is what the point hands the router (router_mask.point_masks: the PCP / DBO variants); use_mask
    # overrides
    mask = batch.mask if use_mask is None else batch.is_padding if use_mask else None
    if p.num_expert_group > 1 or p.scoring == "sigmoid":
        return grouped_topk_torch(batch.logits, p.top_k, p.num_expert_group, p.topk_group, scoring=p.scoring,
                                  bias=batch.bias, renormalize=p.renormalize,
                                  routed_scaling_factor=p.routed_scaling_factor, is_padding=mask)
    return topk_softmax_torch(batch.logits, p.top_k, p.renormalize, is_padding=mask, bias=batch.bias)
