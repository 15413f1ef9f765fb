"""Padding producers (docs/contracts.md#padding-producers): cudagraph, dp (lists and a 2-process gloo group), sp, pcp
(peers and a gloo group), dbo, and the single-rank masks of producer_mask."""

import io

import pytest
import torch

from moebench.inputs import padding
from moebench.inputs.padding import (cudagraph_pad, cudagraph_padded_size, dbo_split, default_capture_sizes, dp_pad,
                              pcp_gather, producer_mask, sp_pad_and_chunk)
from moebench.params import Params


def _rows(n, width=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) + 5.0  # never zero, so added zero rows are distinguishable


def _mask(bits):
    return torch.tensor([bool(b) for b in bits])


# ------------------------------------------------------------------------------------------------ cudagraph


def test_default_capture_sizes():
    sizes = default_capture_sizes()
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] == 512 and len(sizes) == 3 + 64
    assert all(s % 8 == 0 for s in sizes[3:])


@pytest.mark.parametrize("num_real, expected", [(0, 0), (1, 1), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24),
                                                (511, 512), (512, 512), (513, 513), (4000, 4000)])
def test_cudagraph_padded_size_default(num_real, expected):
    assert cudagraph_padded_size(num_real) == expected


def test_cudagraph_padded_size_custom_unsorted():
    sizes = [16, 4, 64]
    assert [cudagraph_padded_size(n, sizes) for n in (1, 4, 5, 16, 17, 64, 65)] == [4, 4, 16, 16, 64, 64, 65]
    with pytest.raises(ValueError):
        cudagraph_padded_size(-1)


def test_cudagraph_pad_rows_and_mask():
    x = _rows(5)
    xp, mask = cudagraph_pad(x)
    assert xp.shape == (8, 3)
    assert torch.equal(xp[:5], x) and torch.equal(xp[5:], torch.zeros(3, 3))
    assert mask.tolist() == [False] * 5 + [True] * 3
    # An incoming mask (e.g. DP padding already there) stays in front.
    xp2, mask2 = cudagraph_pad(x, [6, 12], is_padding=_mask([0, 0, 0, 1, 1]))
    assert xp2.shape[0] == 6 and mask2.tolist() == [False, False, False, True, True, True]


def test_cudagraph_pad_above_largest_is_eager():
    x = _rows(10)
    xp, mask = cudagraph_pad(x, [2, 4, 8])
    assert xp is x and mask.dtype == torch.bool and not mask.any() and mask.shape == (10,)


# ------------------------------------------------------------------------------------------------ dp


def test_dp_pad_to_max_with_list():
    x = _rows(3, 4)
    xp, mask = dp_pad(x, [3, 7, 5])
    assert xp.shape == (7, 4) and torch.equal(xp[:3], x) and not xp[3:].any()
    assert mask.tolist() == [False] * 3 + [True] * 4
    x_busiest = _rows(7, 4, seed=1)
    xp, mask = dp_pad(x_busiest, [3, 7, 5])
    assert xp is x_busiest and not mask.any()


def test_dp_pad_argument_errors():
    x = _rows(3)
    with pytest.raises(ValueError):
        dp_pad(x)
    with pytest.raises(ValueError):
        dp_pad(x, [4, 5])  # this rank's count is not in the list
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 3, got: 2"):
        dp_pad(x, [3, 5], is_padding=_mask([0, 1]))


def _gloo_worker(ctx):
    # dp: rank 0 has 2 rows, rank 1 has 5; both end with 5.
    num_local = (2, 5)[ctx.rank]
    x = _rows(num_local, 3, seed=10 + ctx.rank)
    xp, mask = dp_pad(x, group=ctx.group)
    # pcp: 3 rows per rank, different masks per rank (rank 1 sends None: all real).
    xl = _rows(3, 2, seed=20 + ctx.rank)
    ml = _mask([0, 1, 1]) if ctx.rank == 0 else None
    xg, mg = pcp_gather(xl, ml, group=ctx.group)
    buf = io.BytesIO()  # as bytes: a tensor sent through the pipe would need this rank alive after it reports
    torch.save({"dp": (x, xp, mask), "pcp": (xl, xg, mg)}, buf)
    return buf.getvalue()


def test_dp_pad_and_pcp_gather_with_gloo_group(gloo_ranks):
    res = [torch.load(io.BytesIO(b)) for b in gloo_ranks.run(_gloo_worker, 2, timeout_s=120)]
    for r in range(2):
        x, xp, mask = res[r]["dp"]
        assert xp.shape == (5, 3) and torch.equal(xp[:x.shape[0]], x) and not xp[x.shape[0]:].any()
        assert mask.tolist() == [False] * x.shape[0] + [True] * (5 - x.shape[0])
    xl0, xl1 = res[0]["pcp"][0], res[1]["pcp"][0]
    for r in range(2):
        _, xg, mg = res[r]["pcp"]
        assert torch.equal(xg, torch.cat([xl0, xl1]))  # rank-major
        assert mg.dtype == torch.bool and mg.tolist() == [False, True, True, False, False, False]


# ------------------------------------------------------------------------------------------------ sp


def test_sp_pad_and_chunk():
    x = _rows(7)
    chunks = [sp_pad_and_chunk(x, _mask([0, 0, 0, 0, 0, 0, 1]), 3, r) for r in range(3)]
    assert [c[0].shape[0] for c in chunks] == [3, 3, 3]
    assert torch.equal(torch.cat([c[0] for c in chunks])[:7], x)
    assert not torch.cat([c[0] for c in chunks])[7:].any()
    assert [c[1].tolist() for c in chunks] == [[False] * 3, [False] * 3, [True, True, True]]
    # No mask given: only SP's own padding is True; exact multiples add nothing.
    assert sp_pad_and_chunk(x, None, 4, 3)[1].tolist() == [False, True]
    x8 = _rows(8)
    xc, mc = sp_pad_and_chunk(x8, None, 4, 1)
    assert torch.equal(xc, x8[2:4]) and not mc.any()
    with pytest.raises(ValueError):
        sp_pad_and_chunk(x, None, 2, 2)
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 7, got: 6"):
        sp_pad_and_chunk(x, _mask([0] * 6), 2, 0)


# ------------------------------------------------------------------------------------------------ pcp


def test_pcp_gather_peers_rank_major_and_row_aligned():
    num_ranks, rows = 3, 4
    peers = [(_rows(rows, 2, seed=30 + r), _mask(bits)) for r, bits in
             enumerate([[0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 0]])]
    xg, mg = pcp_gather(peers[1][0], peers[1][1], peers=peers)
    assert xg.shape == (num_ranks * rows, 2) and mg.shape == (num_ranks * rows,)
    for i in range(num_ranks * rows):
        r, j = divmod(i, rows)
        assert torch.equal(xg[i], peers[r][0][j]) and bool(mg[i]) == bool(peers[r][1][j])
    assert mg.tolist() == [False, False, True, True, False, True, False, True, True, True, True, False]


def test_pcp_local_mask_on_gathered_rows_raises():
    peers = [(_rows(2, 2, seed=r), _mask([0, 1])) for r in range(2)]
    xg, mg = pcp_gather(peers[0][0], peers[0][1], peers=peers)
    with pytest.raises(ValueError, match=r"^is_padding size mismatch, expected: 4, got: 2$"):
        padding.check_mask(peers[0][1], xg.shape[0])
    padding.check_mask(mg, xg.shape[0])  # the gathered mask fits


def test_pcp_local_mask_rejected_by_router():
    from moebench.kernels.topk_softmax import topk_softmax_torch

    peers = [(_rows(2, 8, seed=r), _mask([0, 1])) for r in range(2)]
    logits, mg = pcp_gather(peers[0][0], peers[0][1], peers=peers)
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 4, got: 2"):
        topk_softmax_torch(logits, 2, True, is_padding=peers[0][1])
    _, ids = topk_softmax_torch(logits, 2, True, is_padding=mg)
    assert (ids[mg] == -1).all() and (ids[~mg] >= 0).all()


def test_pcp_gather_errors_and_single_rank():
    x = _rows(3)
    with pytest.raises(ValueError):
        pcp_gather(x, None, peers=[(x, None), (_rows(2), None)])
    with pytest.raises(ValueError, match="is_padding size mismatch"):
        pcp_gather(x, None, peers=[(x, None), (_rows(3), _mask([0, 1]))])
    xg, mg = pcp_gather(x, None)
    assert torch.equal(xg, x) and mg.tolist() == [False] * 3


# ------------------------------------------------------------------------------------------------ dbo


def test_dbo_split():
    x = _rows(7)
    mask = _mask([0, 0, 0, 0, 1, 1, 1])
    (x0, m0), (x1, m1) = dbo_split(x, mask)
    assert torch.equal(x0, x[:3]) and torch.equal(x1, x[3:])
    assert m0.tolist() == [False] * 3 and m1.tolist() == [False, True, True, True]
    (_, n0), (_, n1) = dbo_split(x, None)
    assert n0 is None and n1 is None
    with pytest.raises(ValueError, match="is_padding size mismatch, expected: 7, got: 6"):
        dbo_split(x, mask[:6])


# ------------------------------------------------------------------------------------------------ producer_mask


def _p(producer, **kw):
    return Params(padding_producer=producer, **kw)


def test_producer_mask_each_producer():
    F, T = False, True
    assert producer_mask(_p("ratio", num_tokens=5, padding_ratio=0.4)).tolist() == [F, F, F, T, T]
    # cudagraph: 13 real tokens -> capture size 16; ratio unused.
    assert producer_mask(_p("cudagraph", num_tokens=13, padding_ratio=0.5)).tolist() == [F] * 13 + [T] * 3
    assert producer_mask(_p("cudagraph", num_tokens=5, capture_sizes=[4, 6])).tolist() == [F] * 5 + [T]
    assert producer_mask(_p("cudagraph", num_tokens=600)).tolist() == [F] * 600  # eager above 512
    # dp: this rank has 10 - 3 real tokens, the busiest 10.
    assert producer_mask(_p("dp", num_tokens=10, padding_ratio=0.3)).tolist() == [F] * 7 + [T] * 3
    assert producer_mask(_p("dp", num_tokens=10, padding_ratio=0.3, producer_size=1)).tolist() == [F] * 7
    # sp: 10 rows with 2 tail padding, TP 4 -> 12 rows, last rank's chunk = rows 9..11.
    assert producer_mask(_p("sp", num_tokens=10, padding_ratio=0.2, producer_size=4)).tolist() == [T, T, T]
    assert producer_mask(_p("sp", num_tokens=11, padding_ratio=0.0, producer_size=4)).tolist() == [F, F, T]
    # pcp: 2 ranks x 5 rows, round(10 * 0.3) = 3 padded -> 7 real: rank 0 has 4, rank 1 has 3.
    assert producer_mask(_p("pcp", num_tokens=5, padding_ratio=0.3, producer_size=2)).tolist() == \
        [F, F, F, F, T] + [F, F, F, T, T]
    # dbo: 9 rows, 4 tail padding, second micro-batch = rows 4..8.
    assert producer_mask(_p("dbo", num_tokens=9, padding_ratio=0.45)).tolist() == [F, T, T, T, T]


def test_make_batch_uses_producer_mask():
    from moebench.inputs import make_batch

    p = _p("pcp", num_tokens=6, padding_ratio=0.5, producer_size=2, hidden=16, num_experts=8, top_k=2)
    batch = make_batch(p, "cpu")
    assert torch.equal(batch.is_padding, producer_mask(p))
    assert batch.logits.shape == (12, 8) and batch.hidden.shape == (12, 16)


def test_point_masks_hand_the_router_what_each_knob_says():
    """One producer run gives is_padding and the router's mask: the gathered / sliced mask (the fixes), the
    rank-local or full-batch mask (the bugs), or none."""
    from moebench.inputs.router_mask import point_masks

    F, T = False, True
    pcp = dict(num_tokens=5, padding_ratio=0.3, producer_size=2)
    gathered = [F, F, F, F, T] + [F, F, F, T, T]
    is_padding, mask = point_masks(_p("pcp", **pcp), "cpu")
    assert is_padding.tolist() == gathered and mask is is_padding
    is_padding, mask = point_masks(_p("pcp", pcp_mask="local", **pcp), "cpu")
    assert is_padding.tolist() == gathered and mask.tolist() == [F, F, F, F, T]  # rank 0's own rows
    dbo = dict(num_tokens=9, padding_ratio=0.45)
    is_padding, mask = point_masks(_p("dbo", **dbo), "cpu")
    assert is_padding.tolist() == [F, T, T, T, T] and mask is is_padding
    assert point_masks(_p("dbo", dbo_mask="full", **dbo), "cpu")[1].tolist() == [F] * 5 + [T] * 4
    assert point_masks(_p("dbo", dbo_mask="none", **dbo), "cpu")[1] is None
    assert point_masks(_p("ratio", mask=False, **dbo), "cpu")[1] is None
