"""The receive buffer shared by the expert-id tests (test_globalize_recv_topk_idx, test_apply_expert_map,
tests/bench/test_bench_expert_ids)."""

from __future__ import annotations

import torch

from moebench.bench.expert_ids import make_receive_buffer


def receive_buffer(num_recv, capacity, K, local_experts, *, seed, dtype=torch.int64):
    """(recv [capacity, K] of `dtype`, num_recv int32 [1]): num_recv random rows of local ids in [-1,
    local_experts), each with work in slot 0, then make_receive_buffer's valid-looking garbage."""
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-1, local_experts, (num_recv, K), generator=g)
    local[:, 0] = torch.randint(0, local_experts, (num_recv,), generator=g)  # every received row has work
    recv, n = make_receive_buffer(local, capacity, local_experts, generator=g)
    return recv.to(dtype), n
