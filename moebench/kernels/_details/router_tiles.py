"""Triton building blocks shared by the routers (topk_softmax, grouped_topk): 3-D row tiles, int-key arg-max picks
and the row store. Public names: each router module's kernels call them."""

from __future__ import annotations

import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-2147483648)  # the "already picked" key (a jit-visible global must be constexpr)
INT64_MIN = tl.constexpr(-9223372036854775808)  # the "already picked" packed key


def triton_version() -> tuple[int, int]:
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:2])
    return major, minor


# The router tiles are 3-D: (slice, row, column-within-slice), the column axis contiguous in memory. Triton's
# coalescing gives lanes to that axis first and then to the next axis in its order of the two non-contiguous ones,
# which it breaks differently across releases (3.6: lower axis first; 3.9: higher axis first). The kernels put the
# row axis where the installed Triton spreads lanes and warps next, so that a row stays inside one warp and the
# slice axis stays inside each thread (no reduction through shared memory). Q_AXIS is where the slice axis goes.
Q_AXIS = 1 if triton_version() < (3, 9) else 0


@triton.jit
def orderable_key(x):
    """fp32 -> int32 whose signed order is the float order (equal floats <=> equal keys, for +-0 aside).

    Negative floats have their magnitude bits flipped so that a larger magnitude sorts lower; -inf maps above
    INT32_MIN, which therefore stays free as the "already picked" marker. Scores here are never -0.0 (p >= +0 and
    +0 + -0 = +0), so the one place the key order and the float order differ cannot arise.
    """
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def zero_non_finite(x):
    """NaN and +-Inf -> +0.0 (the routers' clamp of their activated scores; see router_common.zero_non_finite_torch).
    One compare and one select: |x| < inf is false exactly for NaN and the infinities."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def program_rows(pad_ptr, num_tokens, BLOCK_T: tl.constexpr, HAS_PAD: tl.constexpr):
    """(rows, in_range, live) of this program's BLOCK_T rows: live = in range and not padded (a padded row's
    logits are never read; it only gets -1 / 0.0 written)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < num_tokens
    live = in_range
    if HAS_PAD:
        live = in_range & (tl.load(pad_ptr + rows, mask=in_range, other=1) == 0)
    return rows, in_range, live


@triton.jit
def rows_to_tile(v, Q_AXIS: tl.constexpr):
    """A per-row vector [R] as [R, 1, 1] or [1, R, 1], to broadcast against a tile whose slice axis is Q_AXIS."""
    return tl.expand_dims(tl.expand_dims(v, Q_AXIS), 2)


@triton.jit
def slice_index(n: tl.constexpr, Q_AXIS: tl.constexpr):
    """arange(n) along the slice axis of a tile: [1, n, 1] or [n, 1, 1]."""
    return tl.expand_dims(tl.expand_dims(tl.arange(0, n), 1 - Q_AXIS), 2)


@triton.jit
def slot_tile(R: tl.constexpr, K_PAD: tl.constexpr, Q_AXIS: tl.constexpr):
    """Slot numbers 0..K_PAD-1 on the last axis of a [R, 1, K_PAD] / [1, R, K_PAD] tile: per-row outputs kept
    in the main tile's layout (a separate 2-D [R, K] layout costs a shared-memory conversion per pick)."""
    return rows_to_tile(tl.zeros([R], tl.int32), Q_AXIS) + tl.arange(0, K_PAD)[None, None, :]


@triton.jit
def row_reduce_max(x, Q_AXIS: tl.constexpr):
    return tl.max(tl.max(x, 2), Q_AXIS)


@triton.jit
def row_reduce_sum(x, Q_AXIS: tl.constexpr):
    return tl.sum(tl.sum(x, 2), Q_AXIS)


@triton.jit
def pick_topk_3d(key, experts, K: tl.constexpr, K_PAD: tl.constexpr, NONE: tl.constexpr, Q_AXIS: tl.constexpr):
    """K arg-max picks per row of `key`, a 3-D tile with slice axis Q_AXIS and rows on the other leading axis:
    larger key first, ties to the lower expert id. `experts` (broadcastable to the tile) holds each position's
    expert id, NONE (above every id) where the position is padding. Returns the ids in pick order as a slot tile
    (see slot_tile; slots >= K hold NONE).
    """
    slot = slot_tile(key.shape[1 - Q_AXIS], K_PAD, Q_AXIS)
    ids = tl.where(slot < 0, 0, NONE)
    for k in tl.static_range(K):
        best = row_reduce_max(key, Q_AXIS)
        first = tl.min(tl.min(tl.where(key == rows_to_tile(best, Q_AXIS), experts, NONE), 2), Q_AXIS)
        key = tl.where(experts == rows_to_tile(first, Q_AXIS), INT32_MIN, key)
        ids = tl.where(slot == k, rows_to_tile(first, Q_AXIS), ids)
    return ids


@triton.jit
def pack_keys(key, index, NONE: tl.constexpr):
    """int64 keys whose signed order is (key descending, index ascending): key << 32 | (NONE - index).

    `key` int32 (an orderable_key), `index` < 2^31 with NONE >= every index, so the low half is in [0, NONE] and
    the lower of two indices under an equal key gives the larger packed key. Every packed key exceeds INT64_MIN
    because no orderable_key is INT32_MIN.
    """
    return (key.to(tl.int64) << 32) | (NONE - index).to(tl.int64)


@triton.jit
def pick_topk_packed_3d(key, experts, K: tl.constexpr, K_PAD: tl.constexpr, NONE: tl.constexpr,
                        Q_AXIS: tl.constexpr):
    """pick_topk_3d with one reduction per pick: the max of the packed (key, expert) keys is the pick itself,
    and since packed keys are distinct within a row, key equality knocks out exactly the picked position.
    Same arguments and result as pick_topk_3d (padding positions hold `experts` == NONE: low half 0, below every
    real expert of equal key)."""
    packed = pack_keys(key, experts, NONE)
    slot = slot_tile(key.shape[1 - Q_AXIS], K_PAD, Q_AXIS)
    ids = tl.where(slot < 0, 0, NONE)
    for k in tl.static_range(K):
        best = row_reduce_max(packed, Q_AXIS)
        first = NONE - (best & 0x7FFFFFFF).to(tl.int32)  # the low half (< 2^31)
        packed = tl.where(packed == rows_to_tile(best, Q_AXIS), INT64_MIN, packed)
        ids = tl.where(slot == k, rows_to_tile(first, Q_AXIS), ids)
    return ids


@triton.jit
def pick_topk(key, experts, K: tl.constexpr, K_PAD: tl.constexpr, NONE: tl.constexpr, Q_AXIS: tl.constexpr,
              PACKED: tl.constexpr):
    """The routers' expert pick under the config's selection (router_common.RouterConfig.selection)."""
    if PACKED:
        return pick_topk_packed_3d(key, experts, K, K_PAD, NONE, Q_AXIS)
    else:
        return pick_topk_3d(key, experts, K, K_PAD, NONE, Q_AXIS)


@triton.jit
def store_rows(ids_ptr, weights_ptr, ids, w, rows, in_range, live, K: tl.constexpr, K_PAD: tl.constexpr,
               RENORMALIZE: tl.constexpr, scale, Q_AXIS: tl.constexpr):
    """Renormalise and scale the weights, then write both slot tiles (padded rows: -1 / 0.0) to [T, K] rows."""
    slot = slot_tile(rows.shape[0], K_PAD, Q_AXIS)
    slot_ok = slot < K
    w = finish_weights(w, slot_ok, RENORMALIZE) * scale
    out_off = rows_to_tile(rows.to(tl.int64), Q_AXIS) * K + slot
    store = rows_to_tile(in_range, Q_AXIS) & slot_ok
    live3 = rows_to_tile(live, Q_AXIS)
    tl.store(ids_ptr + out_off, tl.where(live3, ids, -1), mask=store)
    tl.store(weights_ptr + out_off, tl.where(live3, w, 0.0), mask=store)


@triton.jit
def finish_weights(w, slot_ok, RENORMALIZE: tl.constexpr):
    """Zero the unused slots and renormalise over the K used ones (a row summing to 0 is left as is)."""
    w = tl.where(slot_ok, w, 0.0)
    if RENORMALIZE:
        # one reciprocal per row and a multiply per slot (the slot tiles repeat in every lane of a row)
        total = tl.sum(w, 2)
        w = w * tl.expand_dims(tl.where(total == 0.0, 1.0, 1.0 / total), 2)
    return w

