"""apply_expert_map (docs/contracts.md "Expert-id bookkeeping"): the expert map, Triton vs the torch reference, -1
never wrapping, never in place, and the oblivious twin's wrap."""

import pytest
import torch

from moebench.check import poison
from moebench.kernels import apply_expert_map as apply_expert_map_export
from moebench.kernels import apply_expert_map_torch as apply_expert_map_torch_export
from moebench.kernels import globalize_recv_topk_idx as globalize_export
from moebench.kernels import globalize_recv_topk_idx_torch as globalize_torch_export
from moebench.kernels.apply_expert_map import (apply_expert_map, apply_expert_map_oblivious,
                                               apply_expert_map_oblivious_torch, apply_expert_map_torch,
                                               build_expert_map)
from moebench.kernels.globalize_recv_topk_idx import (globalize_recv_topk_idx, globalize_recv_topk_idx_oblivious,
                                                      globalize_recv_topk_idx_torch)
from expert_id_helpers import receive_buffer


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_exports():
    assert apply_expert_map_export is apply_expert_map and apply_expert_map_torch_export is apply_expert_map_torch
    assert globalize_export is globalize_recv_topk_idx and globalize_torch_export is globalize_recv_topk_idx_torch
    assert apply_expert_map.oblivious is apply_expert_map_oblivious
    assert globalize_recv_topk_idx.oblivious is globalize_recv_topk_idx_oblivious


@pytest.mark.parametrize("ep_size,rank", [(1, 0), (4, 0), (4, 3), (8, 5)])
def test_build_expert_map(ep_size, rank):
    E = 64
    m = build_expert_map(E, ep_size, rank, generator=gen(rank))
    local = E // ep_size
    owned = m[rank * local:(rank + 1) * local]
    assert m.dtype == torch.int32 and m.shape == (E,)
    assert torch.equal(owned.sort().values, torch.arange(local, dtype=torch.int32))
    assert int((m >= 0).sum()) == local
    assert torch.equal(build_expert_map(E, ep_size, rank)[rank * local:(rank + 1) * local],
                       torch.arange(local, dtype=torch.int32))
    with pytest.raises(ValueError):
        build_expert_map(E, 3, 0)


def routed_ids(T, K, E, *, seed, dtype=torch.int32, frac_padding=0.3):
    g = gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dtype)
    padded = torch.rand(T, generator=g) < frac_padding
    padded[-1] = True
    ids[padded] = -1
    return ids, padded


@pytest.mark.parametrize("T,K,E,ep_size,dtype", [(37, 6, 64, 4, torch.int32), (300, 8, 256, 8, torch.int64),
                                                 (5, 1, 16, 1, torch.int32)])
def test_apply_expert_map_matches_reference(T, K, E, ep_size, dtype):
    ids, padded = routed_ids(T, K, E, seed=T, dtype=dtype)
    rank = ep_size - 1
    m = build_expert_map(E, ep_size, rank, generator=gen(1))
    before = ids.clone()
    out = poison(torch.empty(T, K, dtype=torch.int64))
    got = apply_expert_map(ids, m, out=out)
    assert got is out
    ref = apply_expert_map_torch(ids, m)
    assert torch.equal(got, ref)
    assert torch.equal(ids, before)  # never in place
    assert (got[padded] == -1).all()  # -1 stays -1
    # Non-local ids map to -1, local ones to their local id (checked against the map directly).
    loc = E // ep_size
    is_local = (ids >= rank * loc) & (ids < (rank + 1) * loc)
    assert (got[(ids >= 0) & ~is_local] == -1).all()
    assert torch.equal(got[is_local], m[ids[is_local].long()].long())
    if ep_size > 1:
        assert ((ids >= 0) & ~is_local).any() and is_local.any()


def test_apply_expert_map_new_tensor_any_shape():
    E = 32
    m = build_expert_map(E, 2, 1, generator=gen(2))
    ids = torch.randint(-1, E, (5105,), generator=gen(3), dtype=torch.int32)  # spans 3 programs of 2048
    got = apply_expert_map(ids, m)
    assert got.dtype == torch.int64 and got.shape == ids.shape and got.data_ptr() != ids.data_ptr()
    assert torch.equal(got, apply_expert_map_torch(ids, m))
    three_d = ids[:105].view(3, 5, 7)
    assert torch.equal(apply_expert_map(three_d, m), apply_expert_map_torch(three_d, m))
    strided = ids[:210].view(30, 7)[:, ::2]  # non-contiguous input
    assert torch.equal(apply_expert_map(strided, m), apply_expert_map_torch(strided, m))
    ids64 = ids.long()
    with pytest.raises(ValueError, match="in place"):
        apply_expert_map(ids64, m, out=ids64)
    assert apply_expert_map(ids[:0], m).shape == (0,)


def test_apply_expert_map_out_of_range_ids_read_nothing():
    """Ids >= E (outside the inputs of docs/contracts.md#expert-map) are treated like -1 by both, never read past the map."""
    m = build_expert_map(16, 1, 0)
    ids = torch.tensor([[0, 15, 16, 1000, -1, -7]], dtype=torch.int32)
    expect = torch.tensor([[0, 15, -1, -1, -1, -1]])
    assert torch.equal(apply_expert_map(ids, m), expect)
    assert torch.equal(apply_expert_map_torch(ids, m), expect)


def test_oblivious_expert_map_wraps_minus_one():
    E, ep_size = 64, 4
    rank = ep_size - 1  # owns the last expert
    m = build_expert_map(E, ep_size, rank, generator=gen(5))
    ids, padded = routed_ids(20, 6, E, seed=9)
    got = apply_expert_map_oblivious(ids, m)
    assert torch.equal(got.long(), apply_expert_map_oblivious_torch(ids, m).long())
    last_local = int(m[E - 1])
    assert last_local >= 0
    # Every masked slot turned into real work for the rank's last local expert.
    assert (got[padded] == last_local).all()
    fixed = apply_expert_map(ids, m)
    assert (fixed[padded] == -1).all()
    differs = (got.long() != fixed).any(dim=1)
    assert torch.equal(differs, padded)


@pytest.mark.gpu
def test_gpu_expert_ids_large():
    E = 256
    ids, _ = routed_ids(65536, 8, E, seed=1)
    ids = ids.cuda()
    m = build_expert_map(E, 8, 7, generator=gen(2), device="cuda")
    out = poison(torch.empty(ids.shape, dtype=torch.int64, device="cuda"))
    assert torch.equal(apply_expert_map(ids, m, out=out), apply_expert_map_torch(ids, m))
    recv, n = receive_buffer(40000, 65536, 8, 32, seed=4)
    recv, n = recv.cuda(), n.cuda()
    ref = globalize_recv_topk_idx_torch(recv.clone(), n, 224, E)
    assert torch.equal(globalize_recv_topk_idx(recv, n, 224, E), ref)
