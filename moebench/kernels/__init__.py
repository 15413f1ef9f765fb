"""moebench kernels: each module holds a Triton kernel, its launcher and the plain-torch reference
`<name>_torch` that follows SPEC.md literally, plus its registration for sweeps."""
from moebench.kernels.masked_moe_sum import masked_moe_sum, masked_moe_sum_torch  # noqa: E402,F401
from moebench.kernels.moe_align_block_size import moe_align_block_size, moe_align_block_size_torch  # noqa: E402,F401
from moebench.kernels.prepare_moe_inputs import prepare_moe_inputs, prepare_moe_inputs_torch  # noqa: E402,F401
from moebench.kernels.apply_expert_map import apply_expert_map, apply_expert_map_torch  # noqa: E402,F401
from moebench.kernels.globalize_recv_topk_idx import (  # noqa: E402,F401
    globalize_recv_topk_idx, globalize_recv_topk_idx_torch)
from moebench.kernels.fused_experts import fused_experts, fused_experts_torch  # noqa: E402,F401
from moebench.kernels.topk_softmax import topk_softmax, topk_softmax_torch  # noqa: E402,F401
from moebench.kernels.grouped_topk import grouped_topk, grouped_topk_torch  # noqa: E402,F401
