"""Imbalance figures on hand-computed routings (expected numbers written out by hand), plus a brute-force
cross-check on random routings and the edge cases (-1 everywhere, errors)."""

import json
import math

import pytest
import torch

from moebench.measure.imbalance import imbalance, per_rank_loads

approx = pytest.approx


def _hand_case():
    # E = 4 experts, R = 2 ranks (rank 0: experts 0,1; rank 1: experts 2,3), K = 2.
    ids = torch.tensor([[0, 1],     # real
                        [1, -1],    # real, one slot unused
                        [1, 2],     # real
                        [0, 1],     # padding, still routed (unmasked)
                        [0, 1],     # padding, still routed
                        [-1, -1]],  # padding, masked: counts nowhere
                       dtype=torch.int32)
    is_padding = torch.tensor([False, False, False, True, True, True])
    return ids, is_padding


def test_hand_computed_routing():
    ids, is_padding = _hand_case()
    r = imbalance(ids, is_padding, num_experts=4, ep_size=2)
    assert r["per_expert_real"] == [1, 3, 1, 0]
    assert r["per_expert_padding"] == [2, 2, 0, 0]
    assert r["per_rank_real"] == [4, 1]
    assert r["per_rank_padding"] == [4, 0]
    assert r["per_rank_tokens_real"] == [3, 1]
    assert r["per_rank_tokens_padding"] == [2, 0]
    assert r["ep_size"] == 2 and r["num_routes"] == 9 and r["num_padding_routes"] == 4
    assert r["num_tokens"] == 6 and r["num_padding_tokens"] == 3

    # All routes per expert: [3, 5, 1, 0], mean 2.25.
    e = r["expert"]
    assert e["max_over_mean"] == approx(5 / 2.25)
    assert e["balancedness"] == approx(0.45)
    assert e["cv"] == approx(math.sqrt((0.75**2 + 2.75**2 + 1.25**2 + 2.25**2) / 4) / 2.25)
    assert e["hottest"] == 1 and e["hottest_share"] == approx(5 / 9)

    # All routes per rank: [8, 1], mean 4.5.
    k = r["rank"]
    assert k["max_over_mean"] == approx(8 / 4.5)
    assert k["balancedness"] == approx(4.5 / 8)
    assert k["cv"] == approx(3.5 / 4.5)
    assert k["slowest_rank"] == 0 and k["slowest_load"] == 8
    assert k["mean_load"] == approx(4.5) and k["slowest_excess"] == approx(3.5)
    assert k["slowest_excess_ratio"] == approx(3.5 / 4.5)

    # Real routes only: experts [1, 3, 1, 0] (mean 1.25), ranks [4, 1] (mean 2.5).
    re, rk = r["real_only"]["expert"], r["real_only"]["rank"]
    assert re["max_over_mean"] == approx(2.4) and re["balancedness"] == approx(1.25 / 3)
    assert re["cv"] == approx(math.sqrt((0.25**2 + 1.75**2 + 0.25**2 + 1.25**2) / 4) / 1.25)
    assert re["hottest"] == 1 and re["hottest_share"] == approx(0.6)
    assert rk["max_over_mean"] == approx(1.6) and rk["balancedness"] == approx(0.625) and rk["cv"] == approx(0.6)
    assert rk["slowest_rank"] == 0 and rk["slowest_load"] == 4 and rk["mean_load"] == approx(2.5)
    assert rk["slowest_excess"] == approx(1.5) and rk["slowest_excess_ratio"] == approx(0.6)

    json.dumps(r)  # plain Python numbers only


def test_ties_pick_first_and_no_mask():
    # E = 6, R = 3; loads per expert [0, 2, 0, 2, 1, 1] -> hottest is the first max (1); ranks [2, 2, 2].
    ids = torch.tensor([[1, 3], [3, 4], [1, 5]])
    r = imbalance(ids, None, num_experts=6, ep_size=3)
    assert r["per_expert_real"] == [0, 2, 0, 2, 1, 1] and r["per_expert_padding"] == [0] * 6
    assert r["num_padding_routes"] == 0 and r["num_padding_tokens"] == 0
    assert r["expert"]["hottest"] == 1 and r["expert"]["hottest_share"] == approx(2 / 6)
    assert r["rank"]["max_over_mean"] == approx(1.0) and r["rank"]["balancedness"] == approx(1.0)
    assert r["rank"]["cv"] == approx(0.0) and r["rank"]["slowest_rank"] == 0
    assert r["rank"]["slowest_excess"] == approx(0.0) and r["rank"]["slowest_excess_ratio"] == approx(0.0)
    assert r["real_only"] == {"expert": r["expert"], "rank": r["rank"]}


def test_zero_routes_convention():
    for ids in (torch.full((3, 2), -1), torch.empty((0, 4), dtype=torch.int64)):
        r = imbalance(ids, torch.ones(ids.shape[0], dtype=torch.bool), num_experts=4, ep_size=2)
        assert r["num_routes"] == 0 and r["per_rank_real"] == [0, 0] and r["per_expert_padding"] == [0] * 4
        for fig in (r["expert"], r["real_only"]["expert"]):
            assert fig == {"max_over_mean": 0.0, "balancedness": 1.0, "cv": 0.0, "hottest": 0, "hottest_share": 0.0}
        for fig in (r["rank"], r["real_only"]["rank"]):
            assert fig == {"max_over_mean": 0.0, "balancedness": 1.0, "cv": 0.0, "slowest_rank": 0,
                           "slowest_load": 0, "mean_load": 0.0, "slowest_excess": 0.0, "slowest_excess_ratio": 0.0}


def test_only_padding_routes_real_only_is_empty():
    ids = torch.tensor([[2, 3], [2, 3]])
    r = imbalance(ids, torch.tensor([True, True]), num_experts=4, ep_size=2)
    assert r["per_rank_padding"] == [0, 4] and r["rank"]["slowest_rank"] == 1
    assert r["rank"]["slowest_excess"] == approx(2.0) and r["rank"]["slowest_excess_ratio"] == approx(1.0)
    assert r["real_only"]["rank"]["balancedness"] == 1.0 and r["real_only"]["rank"]["slowest_load"] == 0


def test_errors():
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 2, got: 3"):
        imbalance(ids, torch.zeros(3, dtype=torch.bool), 4, 2)
    with pytest.raises(ValueError, match="does not divide"):
        imbalance(ids, None, 4, 3)
    with pytest.raises(ValueError, match="outside"):
        imbalance(torch.tensor([[0, 4]]), None, 4, 1)
    with pytest.raises(ValueError, match="outside"):
        imbalance(torch.tensor([[0, -2]]), None, 4, 1)
    with pytest.raises(ValueError):
        imbalance(torch.tensor([0, 1]), None, 4, 1)


def _brute_force(ids, is_padding, E, R):
    """A plain loop over every slot: the independent reference for random routings."""
    real, pad = [0] * E, [0] * E
    tok_real, tok_pad = [0] * R, [0] * R
    for t, row in enumerate(ids.tolist()):
        ranks = set()
        for e in row:
            if e == -1:
                continue
            (pad if is_padding[t] else real)[e] += 1
            ranks.add(e // (E // R))
        for rk in ranks:
            (tok_pad if is_padding[t] else tok_real)[rk] += 1
    return real, pad, tok_real, tok_pad


@pytest.mark.parametrize("E, R, K, T", [(8, 2, 2, 37), (16, 4, 6, 50), (12, 3, 3, 1)])
def test_random_routing_matches_brute_force(E, R, K, T):
    g = torch.Generator().manual_seed(E * 100 + T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    is_padding = torch.rand(T, generator=g) < 0.4
    r = imbalance(ids, is_padding, E, R)
    real, pad, tok_real, tok_pad = _brute_force(ids, is_padding.tolist(), E, R)
    assert r["per_expert_real"] == real and r["per_expert_padding"] == pad
    assert r["per_rank_tokens_real"] == tok_real and r["per_rank_tokens_padding"] == tok_pad
    loads = per_rank_loads(ids, E, R)
    assert loads.dtype == torch.int64 and loads.shape == (R,)
    assert loads.tolist() == [a + b for a, b in zip(r["per_rank_real"], r["per_rank_padding"])]
    assert sum(r["per_rank_real"]) == sum(real)


@pytest.mark.gpu
def test_cuda_tensors_give_the_same_figures():
    ids, is_padding = _hand_case()
    assert imbalance(ids.cuda(), is_padding.cuda(), 4, 2) == imbalance(ids, is_padding, 4, 2)
    assert per_rank_loads(ids.cuda(), 4, 2).device.type == "cuda"
