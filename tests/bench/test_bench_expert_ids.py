"""bench/expert_ids.py: the receive buffer the globalize cases are built on, and the registered apply_expert_map /
globalize_recv_topk_idx cases (checks pass, the oblivious twins count their harm)."""

import pytest
import torch

from moebench.bench.expert_ids import make_receive_buffer
from tests.kernels.expert_id_helpers import receive_buffer


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_receive_buffer_tail_looks_valid():
    recv, n = receive_buffer(10, 200, 8, 32, seed=1)
    assert n.dtype == torch.int32 and n.tolist() == [10]
    tail = recv[10:]
    assert (tail >= 0).float().mean() > 0.9 and (tail < 32).all()
    with pytest.raises(ValueError):
        make_receive_buffer(torch.zeros(5, 2, dtype=torch.int64), 4, 8, generator=gen(0))


def test_registered_impls_check_and_count_harm():
    from moebench.registry import RunContext, get
    from moebench.params import Params

    ctx = RunContext(device=torch.device("cpu"))
    p = Params(num_tokens=40, padding_ratio=0.5, num_experts=32, top_k=6, ep_size=4, num_max_tokens_per_rank=64)
    for kernel, stage in (("apply_expert_map", "expert_map"), ("globalize_recv_topk_idx", "globalize")):
        harm = {}
        for variant in ("triton", "torch", "oblivious"):
            impl = get(f"{kernel}.{variant}")
            assert impl.targets == ("kernel",)
            case = impl.build(p, ctx)
            res = case.check()
            assert res.ok, (kernel, variant, res.detail)
            assert case.nvtx_stage == stage and case.bytes_moved > 0
            harm[variant] = case.info["corrupted_rows"]
        assert harm["triton"] == 0 and harm["torch"] == 0 and harm["oblivious"] > 0, (kernel, harm)
