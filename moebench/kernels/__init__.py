"""moebench.kernels: the MoE kernels as a library, importable alone (it imports nothing of the benchmark harness).

Each module is one op: its Triton kernel(s) and launcher, the plain-torch reference `<op>_torch` that follows
docs/contracts.md literally, and, where the pre-fix behaviour is a function of its own, the mask-oblivious twin
`<op>_oblivious`. Helpers shared by several ops' kernels live in `kernels._details`. The benchmark cases that time
and check these ops are in `moebench.bench`.
"""

from moebench.kernels.apply_expert_map import apply_expert_map, apply_expert_map_torch
from moebench.kernels.fused_experts import fused_experts, fused_experts_torch
from moebench.kernels.globalize_recv_topk_idx import globalize_recv_topk_idx, globalize_recv_topk_idx_torch
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch
from moebench.kernels.masked_moe_sum import masked_moe_sum, masked_moe_sum_torch
from moebench.kernels.moe_align_block_size import moe_align_block_size, moe_align_block_size_torch
from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs, prepare_moe_inputs_torch
from moebench.kernels.topk_softmax import topk_softmax, topk_softmax_torch

__all__ = [
    "apply_expert_map", "apply_expert_map_torch",
    "fused_experts", "fused_experts_torch",
    "globalize_recv_topk_idx", "globalize_recv_topk_idx_torch",
    "grouped_topk", "grouped_topk_torch",
    "masked_moe_sum", "masked_moe_sum_torch",
    "moe_align_block_size", "moe_align_block_size_torch",
    "prepare_moe_inputs", "prepare_moe_inputs_torch",
    "topk_softmax", "topk_softmax_torch",
]
