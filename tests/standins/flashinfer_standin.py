"""Stand-in for FlashInfer's `flashinfer.fused_moe.fused_topk_deepseek`, with its call signature."""

import torch

from ._common import grouped_select

MOEBENCH_STANDIN = "flashinfer"  # the moebench.peers Library it stands in for


def fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values, topk_indices,
                        launch_with_pdl=True):
    s = torch.sigmoid(scores.float())
    w, ids = grouped_select(s + bias.float(), s, n_group, topk_group, topk)
    topk_values.copy_(w / w.sum(dim=-1, keepdim=True) * routed_scaling_factor)
    topk_indices.copy_(ids)
