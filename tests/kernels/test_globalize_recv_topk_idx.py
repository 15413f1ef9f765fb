"""globalize_recv_topk_idx (docs/contracts.md "Expert-id bookkeeping"): Triton vs the torch reference in place,
garbage receive rows and bad ids neutralised, and the oblivious twin keeping them."""

import pytest
import torch

from moebench.kernels.globalize_recv_topk_idx import (globalize_oblivious_reference, globalize_recv_topk_idx,
                                                      globalize_recv_topk_idx_oblivious, globalize_recv_topk_idx_torch)
from expert_id_helpers import receive_buffer


@pytest.mark.parametrize("num_recv,capacity,K,dtype", [(13, 50, 6, torch.int64), (300, 700, 8, torch.int32),
                                                       (0, 9, 3, torch.int64), (40, 40, 1, torch.int64)])
def test_globalize_matches_reference(num_recv, capacity, K, dtype):
    E, ep_size, rank = 64, 4, 2
    local_experts, offset = E // ep_size, rank * (E // ep_size)
    recv, n = receive_buffer(num_recv, capacity, K, local_experts, seed=capacity, dtype=dtype)
    source = recv.clone()
    got = globalize_recv_topk_idx(recv, n, offset, E)
    assert got is recv and got.dtype == dtype  # in place
    ref = globalize_recv_topk_idx_torch(source.clone(), n, offset, E)
    assert torch.equal(got, ref)
    # Garbage rows past num_recv hold valid-looking ids and must all become -1.
    if capacity > num_recv:
        assert (source[num_recv:] >= 0).any()
    assert (got[num_recv:] == -1).all()
    # Received rows: local id + offset where >= 0, else -1.
    head = source[:num_recv].long()
    assert torch.equal(got[:num_recv].long(), torch.where(head >= 0, head + offset, torch.full_like(head, -1)))


def test_globalize_out_of_range_and_negative_ids():
    E, offset = 32, 24
    recv = torch.tensor([[0, 7, 8, 100], [-1, -5, 3, 9], [1, 2, 3, 4]], dtype=torch.int64)
    n = torch.tensor([2], dtype=torch.int32)
    expect = torch.tensor([[24, 31, -1, -1], [-1, -1, 27, -1], [-1, -1, -1, -1]])
    assert torch.equal(globalize_recv_topk_idx(recv.clone(), n, offset, E), expect)
    assert torch.equal(globalize_recv_topk_idx_torch(recv.clone(), n, offset, E), expect)


def test_globalize_argument_errors():
    recv = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_recv"):
        globalize_recv_topk_idx(recv, torch.tensor([1, 2], dtype=torch.int32), 0, 8)
    with pytest.raises(ValueError, match="num_recv"):
        globalize_recv_topk_idx(recv, 3, 0, 8)
    with pytest.raises(ValueError, match="contiguous"):
        globalize_recv_topk_idx(torch.zeros(4, 4, dtype=torch.int64)[:, ::2], torch.tensor([1], dtype=torch.int32),
                                0, 8)


def test_oblivious_globalize_keeps_garbage():
    E, ep_size, rank = 64, 4, 3
    local_experts, offset = E // ep_size, rank * (E // ep_size)
    recv, n = receive_buffer(12, 60, 4, local_experts, seed=7)
    source = recv.clone()
    got = globalize_recv_topk_idx_oblivious(recv, n, offset, E)
    assert got is recv
    assert torch.equal(got, globalize_oblivious_reference(source, offset))
    fixed = globalize_recv_topk_idx(source.clone(), n, offset, E)
    assert torch.equal(got[:12], fixed[:12])  # received rows agree
    garbage_kept = (got[12:] >= offset).any(dim=1)  # stale rows now carry real global expert ids
    assert int(garbage_kept.sum()) >= 40
    assert int((got != fixed).any(dim=1).sum()) == int(garbage_kept.sum())


@pytest.mark.gpu
def test_gpu_globalize_graph_replay_follows_num_recv():
    E, offset, capacity, K = 256, 192, 4096, 8
    recv, n = receive_buffer(3000, capacity, K, 64, seed=3)
    source = recv.cuda()
    buf = source.clone()
    num_recv = n.cuda()
    globalize_recv_topk_idx(buf, num_recv, offset, E)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        globalize_recv_topk_idx(buf, num_recv, offset, E)
    for count in (3000, 17, 0, capacity, 2500):
        buf.copy_(source)
        num_recv.fill_(count)
        graph.replay()
        torch.cuda.synchronize()
        expect = globalize_recv_topk_idx_torch(source.cpu().clone(), torch.tensor([count], dtype=torch.int32),
                                               offset, E)
        assert torch.equal(buf.cpu(), expect), count
        assert (buf[count:] == -1).all()
