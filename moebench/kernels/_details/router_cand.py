"""Triton building blocks of the routers' candidate selection ("cand<M>" router configs; the cost model is in
topk_softmax's module docstring).

A row of E experts is held as 8 "levels", 2-D [BLOCK_T, LANES] tiles (or their transpose, see ROW_AXIS): level
v, column j holds expert v * LANES + j (grouped_topk: level v = group v). Every score becomes a coarse int32 key
(its orderable key with the low B bits replaced by the inverted expert id: distinct within a row, one int32 max per
pick). Each column's 8 keys are sorted once (a 19-comparator network, elementwise max/min between the levels), so
a pick is a max over the column heads (level 0) and a shift of the winning column's list; C = K + M candidates are
picked this way, then resolved exactly on their fp32 scores.
Public names: the routers' cand kernels call them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moebench.kernels._details.jit import next_pow2
from moebench.kernels._details.router_tiles import INT32_MIN, orderable_key, triton_version

LEVELS = 8  # keys per column: the sorting network below is written for exactly 8

# The 2-D cand tiles put the rows on axis ROW_AXIS and the columns on CA = 1 - ROW_AXIS. Loads of unknown
# contiguity (the candidates' gathers) are coalesced along the lower axis by Triton 3.6 and along the higher by 3.9
# (router_tiles.Q_AXIS tells the same story for 3-D tiles): the columns go there, so that the gathers keep the
# levels' layout (a row inside one warp) instead of spreading a row over warps (shared-memory reductions).
ROW_AXIS = 1 if triton_version() < (3, 9) else 0


def cand_geometry(e_pad: int, num_candidates: int) -> tuple[int, int]:
    """(LANES, B) of a cand tile: columns per level (at least the candidate slots, which share the levels' layout)
    and the id bits of the coarse keys (enough for every expert id < e_pad)."""
    lanes = max(-(-e_pad // LEVELS), next_pow2(num_candidates))
    return lanes, max(0, (e_pad - 1).bit_length())


@triton.jit
def coarse_key(score, expert, valid, B: tl.constexpr):
    """Coarse int32 key of fp32 scores: orderable_key with its low B bits replaced by (2^B - 1 - expert), so keys
    are distinct within a row, larger key = larger truncated score, then lower expert. Invalid positions (expert
    padding) get INT32_MIN, below every real key (orderable_key(-inf) >> B << B is far above it)."""
    IDMASK: tl.constexpr = (1 << B) - 1
    key = (orderable_key(score) & ~IDMASK) | (IDMASK - expert)
    return tl.where(valid, key, INT32_MIN)


@triton.jit
def cas(a, b):
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def sort8_desc(s0, s1, s2, s3, s4, s5, s6, s7):
    """Elementwise descending sort of 8 tiles (each column's 8 keys): the optimal 19-comparator network."""
    s0, s2 = cas(s0, s2)
    s1, s3 = cas(s1, s3)
    s4, s6 = cas(s4, s6)
    s5, s7 = cas(s5, s7)
    s0, s4 = cas(s0, s4)
    s1, s5 = cas(s1, s5)
    s2, s6 = cas(s2, s6)
    s3, s7 = cas(s3, s7)
    s0, s1 = cas(s0, s1)
    s2, s3 = cas(s2, s3)
    s4, s5 = cas(s4, s5)
    s6, s7 = cas(s6, s7)
    s2, s4 = cas(s2, s4)
    s3, s5 = cas(s3, s5)
    s1, s4 = cas(s1, s4)
    s3, s6 = cas(s3, s6)
    s1, s2 = cas(s1, s2)
    s3, s4 = cas(s3, s4)
    s5, s6 = cas(s5, s6)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def pick_candidates(s0, s1, s2, s3, s4, s5, s6, s7, slot, K: tl.constexpr, C: tl.constexpr, B: tl.constexpr,
                    NONE: tl.constexpr, CA: tl.constexpr):
    """C picks of the largest coarse key per row from 8 column-sorted levels (see sort8_desc).

    Returns (candidate ids as a slot tile [BLOCK_T, LANES], slots >= C holding NONE; per-row truncated key of the
    K-th pick; per-row truncated key of the C-th pick). A pick: the max of the column heads, then the winning
    column (keys are distinct: exactly one) shifts its list up. After pick c only the top C - c - 1 entries of a
    column can still be picked, so deeper levels are left stale."""
    IDMASK: tl.constexpr = (1 << B) - 1
    cids = tl.where(slot < 0, 0, NONE)
    t_k = tl.max(s0, CA) >> B
    t_c = t_k
    for c in tl.static_range(C):
        best = tl.max(s0, CA)
        hit = s0 == tl.expand_dims(best, CA)
        if C - c - 1 > 0:
            s0 = tl.where(hit, s1, s0)
        if C - c - 1 > 1:
            s1 = tl.where(hit, s2, s1)
        if C - c - 1 > 2:
            s2 = tl.where(hit, s3, s2)
        if C - c - 1 > 3:
            s3 = tl.where(hit, s4, s3)
        if C - c - 1 > 4:
            s4 = tl.where(hit, s5, s4)
        if C - c - 1 > 5:
            s5 = tl.where(hit, s6, s5)
        if C - c - 1 > 6:
            s6 = tl.where(hit, s7, s6)
        if C - c - 1 > 7:
            s7 = tl.where(hit, INT32_MIN, s7)
        cids = tl.where(slot == c, tl.expand_dims(IDMASK - (best & IDMASK), CA), cids)
        if c == K - 1:
            t_k = best >> B
        if c == C - 1:
            t_c = best >> B
    return cids, t_k, t_c


@triton.jit
def exact_pick_2d(key, cids, slot, K: tl.constexpr, NONE: tl.constexpr, CA: tl.constexpr):
    """K two-pass picks (max key, then the lowest id holding it, knock-out by id) on a small 2-D candidate tile:
    the exact tie rule among the candidates. Slots without a candidate hold key INT32_MIN and id NONE."""
    ids = tl.where(slot < 0, 0, NONE)
    for k in tl.static_range(K):
        best = tl.max(key, CA)
        first = tl.min(tl.where(key == tl.expand_dims(best, CA), cids, NONE), CA)
        key = tl.where(cids == tl.expand_dims(first, CA), INT32_MIN, key)
        ids = tl.where(slot == k, tl.expand_dims(first, CA), ids)
    return ids


@triton.jit
def store_rows_2d(ids_ptr, weights_ptr, ids, w, slot, rows, in_range, live, K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, scale, CA: tl.constexpr):
    """router_tiles.store_rows for 2-D slot tiles: renormalise, scale, write; padded rows -1 / 0.0."""
    slot_ok = slot < K
    w = tl.where(slot_ok, w, 0.0)
    if RENORMALIZE:
        total = tl.sum(w, CA)
        w = w * tl.expand_dims(tl.where(total == 0.0, 1.0, 1.0 / total), CA)
    w = w * scale
    out_off = tl.expand_dims(rows.to(tl.int64), CA) * K + slot
    store = tl.expand_dims(in_range, CA) & slot_ok
    live2 = tl.expand_dims(live, CA)
    tl.store(ids_ptr + out_off, tl.where(live2, ids, -1), mask=store)
    tl.store(weights_ptr + out_off, tl.where(live2, w, 0.0), mask=store)


@triton.jit
def cand_level(base2, live2, lane, V: tl.constexpr, LANES: tl.constexpr, E: tl.constexpr, MASKED: tl.constexpr):
    """Level V of a row block: (fp32 logits, expert ids, valid); padding experts hold -inf (softmax-neutral)."""
    expert = V * LANES + lane
    valid = expert < E
    if MASKED:
        x = tl.load(base2 + expert, mask=live2 & valid, other=0.0).to(tl.float32)
        x = tl.where(valid, x, float("-inf"))
    else:
        x = tl.load(base2 + expert, mask=live2, other=0.0).to(tl.float32)
    return x, expert, valid


@triton.jit
def row_max_8(x0, x1, x2, x3, x4, x5, x6, x7, CA: tl.constexpr):
    """Row max of 8 levels, expanded back to 2-D: elementwise across the levels first, so one cross-lane reduction."""
    m = tl.maximum(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)),
                   tl.maximum(tl.maximum(x4, x5), tl.maximum(x6, x7)))
    return tl.expand_dims(tl.max(m, CA), CA)


@triton.jit
def row_sum_8(x0, x1, x2, x3, x4, x5, x6, x7, CA: tl.constexpr):
    """[BLOCK_T] row sum of 8 levels (elementwise first, as row_max_8)."""
    return tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), CA)


@triton.jit
def add_bias(score, bias_ptr, expert, valid, HAS_BIAS: tl.constexpr):
    """score + bias[expert] (bias loaded at the tile's full shape, so it gets the tile's layout)."""
    if HAS_BIAS:
        score = score + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    return score


@triton.jit
def key_to_float(key):
    """The inverse of router_tiles.orderable_key (the same xor undoes it)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def group_score_key(key, HAS_BIAS: tl.constexpr, CA: tl.constexpr):
    """[BLOCK_T] orderable key of one group's score from the exact keys of its level: the max, or with a bias the
    top-2 sum (a max occurring twice counts twice). Integer reductions (one REDUX each on sm_80+)."""
    hi = tl.max(key, CA)
    if HAS_BIAS:
        at_hi = key == tl.expand_dims(hi, CA)
        twice = tl.sum(at_hi.to(tl.int32), CA) > 1
        runner_up = tl.max(tl.where(at_hi, INT32_MIN, key), CA)
        top = key_to_float(hi)
        return orderable_key(top + tl.where(twice, top, key_to_float(runner_up)))
    else:
        return hi


@triton.jit
def group_coarse(gkey, V: tl.constexpr, G: tl.constexpr):
    """Coarse key of group V's score (low 3 bits: 7 - V, so distinct and ties to the lower group); padding
    groups INT32_MIN."""
    if V < G:
        return (gkey & ~7) | (7 - V)
    else:
        return gkey * 0 + INT32_MIN


@triton.jit
def nth_of_8(g0, g1, g2, g3, g4, g5, g6, g7, N: tl.constexpr):
    """g_N of 8 named values (N a constexpr)."""
    r = g0
    if N == 1:
        r = g1
    if N == 2:
        r = g2
    if N == 3:
        r = g3
    if N == 4:
        r = g4
    if N == 5:
        r = g5
    if N == 6:
        r = g6
    if N == 7:
        r = g7
    return r
