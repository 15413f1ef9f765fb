"""topk_softmax: the softmax top-k router (SPEC.md "Routers"), Triton kernel beside its eager-torch reference.

p = softmax(logits) in fp32; selection ranks p + bias (bias optional, fp32 [E]); the stored weight is the unbiased
p; ties go to the lower expert index; slots are in descending selection score; `renormalize` divides by the sum of
the K weights (left as is when that sum is 0); padded rows get ids -1 and weights 0.0.

The Triton kernel handles a block of rows per program with the expert axis padded to a power of two (masked). The
K selections are iterative arg-max picks on an int32 image of the fp32 score whose signed order is the float
order: max, then the lowest index attaining it, then knock that one out. Integer keys make both per-pick
reductions single-instruction warp reductions (REDUX) on sm_80+ instead of shuffle trees, and make the tie rule
exact (equal floats <=> equal keys). The weights are recomputed from the K gathered logits (L1-resident), so no
full-width value has to be carried through the picks.

Also here, shared with grouped_topk: input validation, the stable-sort selection of the references, and
`compare_routing`, the check every router case runs (ids exact, near-ties only where the reference's own scores
show one, weights against the reference's scores at the chosen ids).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.kernels._details.jit import check_triton_device, next_pow2
from moebench.kernels._details.args import check_mask

MAX_EXPERTS = 1024  # the Triton routers hold a whole row of scores in registers
MAX_TOP_K = 32
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks shared by both routers and both implementations
# ---------------------------------------------------------------------------------------------------------------

def check_router_args(logits: torch.Tensor, top_k: int, is_padding: torch.Tensor | None,
                      bias: torch.Tensor | None) -> tuple[int, int]:
    """Validate the common router arguments; returns (num_tokens, num_experts)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, num_experts], got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    num_tokens, num_experts = logits.shape
    if num_experts < 1:
        raise ValueError("logits must have at least one expert column")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    check_mask(is_padding, num_tokens)
    if is_padding is not None:
        if is_padding.dtype != torch.bool:
            raise TypeError(f"is_padding must be a bool tensor, got {is_padding.dtype}")
        if is_padding.device != logits.device:
            raise ValueError(f"is_padding is on {is_padding.device}, logits on {logits.device}")
    if bias is not None:
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [{num_experts}], got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a float tensor, got {bias.dtype}")
        if bias.device != logits.device:
            raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    return num_tokens, num_experts


def check_triton_router_limits(num_experts: int, top_k: int) -> None:
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the Triton routers support num_experts <= {MAX_EXPERTS}, got {num_experts}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"the Triton routers support top_k <= {MAX_TOP_K}, got {top_k}")


def router_limits_problem(num_experts: int, top_k: int) -> str | None:
    """Impl.validate helper: why a point is impossible for the routers, or None."""
    if top_k > min(num_experts, MAX_TOP_K):
        return f"top_k: {top_k} > min(num_experts={num_experts}, {MAX_TOP_K})"
    if num_experts > MAX_EXPERTS:
        return f"num_experts: {num_experts} > {MAX_EXPERTS}"
    return None


def router_outputs(num_tokens: int, top_k: int, device: torch.device,
                   out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T,K], ids int32 [T,K]): the caller's buffers (checked) or new ones."""
    if out is None:
        return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
                torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))
    weights, ids = out
    for t, dtype, name in ((weights, torch.float32, "weights"), (ids, torch.int32, "ids")):
        if t.shape != (num_tokens, top_k) or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"out {name} must be a contiguous {dtype} [{num_tokens}, {top_k}] tensor on {device}")
    return weights, ids


# ---------------------------------------------------------------------------------------------------------------
# Reference (eager torch, SPEC.md literally)
# ---------------------------------------------------------------------------------------------------------------

def select_desc_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, in descending order, ties to the lower index (int64 [T, k]).

    torch.topk does not promise which of equal values it returns; a stable descending sort keeps equal values in
    index order, which is exactly the tie rule.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def renormalize_torch(weights: torch.Tensor) -> torch.Tensor:
    """w / sum(w) over the selected slots; a row whose sum is 0 is left unchanged."""
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total == 0, weights, weights / total)


def mask_padded_rows_torch(weights: torch.Tensor, ids: torch.Tensor, is_padding: torch.Tensor | None) -> None:
    """Padded rows: ids -1 and weights 0.0 in every slot (in place)."""
    if is_padding is not None:
        ids.masked_fill_(is_padding[:, None], -1)
        weights.masked_fill_(is_padding[:, None], 0.0)


def _write_out(weights: torch.Tensor, ids: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return weights, ids
    out[0].copy_(weights)
    out[1].copy_(ids)
    return out[0], out[1]


def topk_softmax_scores_torch(logits: torch.Tensor, bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, selection score): p = softmax(logits) in fp32, selection = p + bias (or p)."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs, (probs + bias.float() if bias is not None else probs)


def topk_softmax_torch(logits: torch.Tensor, top_k: int, renormalize: bool, is_padding: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference softmax top-k router: (weights fp32 [T, K], ids int32 [T, K])."""
    num_tokens, _ = check_router_args(logits, top_k, is_padding, bias)
    if out is not None:
        router_outputs(num_tokens, top_k, logits.device, out)
    probs, selection = topk_softmax_scores_torch(logits, bias)
    ids = select_desc_torch(selection, top_k)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = renormalize_torch(weights)
    ids = ids.to(torch.int32)
    mask_padded_rows_torch(weights, ids, is_padding)
    return _write_out(weights, ids, out)


# ---------------------------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------------------------

INT32_MIN = tl.constexpr(-2147483648)  # the "already picked" key (a jit-visible global must be constexpr)


def _triton_version() -> tuple[int, int]:
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in triton.__version__.split(".")[:2])
    return major, minor


# The router tiles are 3-D: (slice, row, column-within-slice), the column axis contiguous in memory. Triton's
# coalescing gives lanes to that axis first and then to the next axis in its order of the two non-contiguous ones,
# which it breaks differently across releases (3.6: lower axis first; 3.9: higher axis first). The kernels put the
# row axis where the installed Triton spreads lanes and warps next, so that a row stays inside one warp and the
# slice axis stays inside each thread (no reduction through shared memory). Q_AXIS is where the slice axis goes.
Q_AXIS = 1 if _triton_version() < (3, 9) else 0


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


@triton.jit
def score_topk(ptrs, live3, cols, row_base, live, rows, bias_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
               K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, Q_AXIS: tl.constexpr):
    """ids ranked by the fp32 score p (+ bias), and the unbiased p at them, as slot tiles."""
    if E == E_PAD:  # no column mask at all, so the loads stay 16-byte vectors
        x = tl.load(ptrs, mask=live3, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=live3 & (cols < E), other=0.0).to(tl.float32)
        x = tl.where(cols < E, x, float("-inf"))
    # softmax in fp32 (rows that are not live hold zeros: harmless, their outputs are overwritten)
    row_max = row_reduce_max(x, Q_AXIS)
    e = tl.exp(x - rows_to_tile(row_max, Q_AXIS))
    inv_sum = 1.0 / row_reduce_sum(e, Q_AXIS)
    score = e * rows_to_tile(inv_sum, Q_AXIS)
    if HAS_BIAS:
        # loaded at the tile's full shape (each row re-reads the L1-resident bias) so that the load gets the tile's
        # layout; a load of the bias alone gets a layout of its own and drags the whole selection into it
        bias_ptrs = bias_ptr + cols + 0 * rows_to_tile(rows, Q_AXIS)
        if E == E_PAD:
            score = score + tl.load(bias_ptrs).to(tl.float32)
        else:
            score = score + tl.load(bias_ptrs, mask=cols < E, other=0.0).to(tl.float32)
    if E != E_PAD:
        score = tl.where(cols < E, score, float("-inf"))
    ids = pick_topk_3d(orderable_key(score), cols, K, K_PAD, E_PAD, Q_AXIS)
    # the unbiased p at the picked ids, recomputed from the gathered logits the same way
    slot_ok = slot_tile(rows.shape[0], K_PAD, Q_AXIS) < K
    xg = tl.load(rows_to_tile(row_base, Q_AXIS) + ids, mask=rows_to_tile(live, Q_AXIS) & slot_ok, other=0.0)
    return ids, tl.exp(xg.to(tl.float32) - rows_to_tile(row_max, Q_AXIS)) * rows_to_tile(inv_sum, Q_AXIS)


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(logits_ptr, bias_ptr, pad_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits,
                         E: tl.constexpr, E_PAD: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PAD: tl.constexpr,
                         RENORMALIZE: tl.constexpr, Q_AXIS: tl.constexpr):
    # Tile: E_PAD // W slices of W experts (expert = q * W + w) by BLOCK_T rows, W at most one warp's worth of
    # 16-byte vectors, so a row never spans two warps (see Q_AXIS).
    NQ: tl.constexpr = E_PAD // W
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < num_tokens
    live = in_range
    if HAS_PAD:
        # a padded row's logits are never read; it only gets -1 / 0.0 written
        live = in_range & (tl.load(pad_ptr + rows, mask=in_range, other=1) == 0)
    row_base = logits_ptr + rows.to(tl.int64) * stride_logits
    cols = slice_index(NQ, Q_AXIS) * W + tl.arange(0, W)[None, None, :]
    ptrs = rows_to_tile(row_base, Q_AXIS) + cols
    live3 = rows_to_tile(live, Q_AXIS)
    ids, w = score_topk(ptrs, live3, cols, row_base, live, rows, bias_ptr, E, E_PAD, K, K_PAD, HAS_BIAS, Q_AXIS)
    store_rows(ids_ptr, weights_ptr, ids, w, rows, in_range, live, K, K_PAD, RENORMALIZE, 1.0, Q_AXIS)


def row_width(e_pad: int, element_size: int) -> int:
    """Experts per row slice W: at most one warp of 16-byte vectors (256 bf16/fp16, 128 fp32)."""
    return min(e_pad, 32 * (16 // element_size))


def router_launch_config(row_elements: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for a router tile whose rows hold `row_elements` (power of two) elements.

    About 4096 elements per program (16 rows of 256 experts, 4 of 1024): 32 fp32 values per thread with 4 warps,
    well inside the register file with x, the scores and the keys live at once, and enough programs at T=8192
    (512) to fill 132 SMs. Small tiles (few experts) get fewer warps rather than more rows than useful.
    """
    block_t = max(1, min(128, 4096 // row_elements))
    num_warps = max(1, min(4, block_t * row_elements // 1024))
    return block_t, num_warps


def triton_router_operands(logits: torch.Tensor, top_k: int, num_experts: int, is_padding: torch.Tensor | None,
                           bias: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor] | None):
    """The Triton routers' common launch preamble (arguments already checked): (logits, bias, weights, ids).

    Limits and device checked, outputs are the caller's buffers or new ones, and logits rows and the bias made
    unit-stride because the kernels address them as row_base + expert.
    """
    check_triton_router_limits(num_experts, top_k)
    check_triton_device(logits, is_padding, bias)
    weights, ids = router_outputs(logits.shape[0], top_k, logits.device, out)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return logits, bias, weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, is_padding: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton softmax top-k router: (weights fp32 [T, K], ids int32 [T, K]); see the module docstring."""
    num_tokens, num_experts = check_router_args(logits, top_k, is_padding, bias)
    logits, bias, weights, ids = triton_router_operands(logits, top_k, num_experts, is_padding, bias, out)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_pow2(num_experts)
    block_t, num_warps = router_launch_config(e_pad)
    grid = (triton.cdiv(num_tokens, block_t),)
    _topk_softmax_kernel[grid](
        logits, bias if bias is not None else logits,
        is_padding.view(torch.uint8) if is_padding is not None else logits,
        weights, ids, num_tokens, logits.stride(0),
        E=num_experts, E_PAD=e_pad, W=row_width(e_pad, logits.element_size()), K=top_k, K_PAD=next_pow2(top_k), BLOCK_T=block_t,
        HAS_BIAS=bias is not None, HAS_PAD=is_padding is not None, RENORMALIZE=bool(renormalize),
        Q_AXIS=Q_AXIS, num_warps=num_warps)
    return weights, ids


# ---------------------------------------------------------------------------------------------------------------
# Checking a router's output against the reference (used by both routers' Case.check and by the tests)
# ---------------------------------------------------------------------------------------------------------------

NEAR_TIE_ULPS = 8  # how close (in fp32 ulps of the operands' magnitude) two selection scores must be to be a tie


@dataclass
class RouterReference:
    """What the reference computed for a batch, enough to judge another implementation's output.

    weights/ids: the reference output. probs: the unbiased fp32 scores [T, E] the weights come from.
    selection: the fp32 selection scores [T, E] before any group masking. magnitude: |probs| + |bias| [T, E],
    the scale of the rounding error in `selection`. Grouped routers also give the per-group scores [T, G], their
    magnitude, and topk_group.
    """

    weights: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor
    selection: torch.Tensor
    magnitude: torch.Tensor
    renormalize: bool
    scale: float = 1.0
    is_padding: torch.Tensor | None = None
    group_scores: torch.Tensor | None = None
    group_magnitude: torch.Tensor | None = None
    topk_group: int = 0

    @property
    def num_groups(self) -> int:
        return 1 if self.group_scores is None else self.group_scores.shape[1]


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                           is_padding: torch.Tensor | None = None, bias: torch.Tensor | None = None
                           ) -> RouterReference:
    weights, ids = topk_softmax_torch(logits, top_k, renormalize, is_padding=is_padding, bias=bias)
    probs, selection = topk_softmax_scores_torch(logits, bias)
    magnitude = probs.abs() + (bias.float().abs() if bias is not None else 0.0)
    return RouterReference(weights, ids, probs, selection, magnitude, renormalize, 1.0, is_padding)


def _tolerance(magnitude: torch.Tensor) -> torch.Tensor:
    return magnitude * (NEAR_TIE_ULPS * torch.finfo(torch.float32).eps) + torch.finfo(torch.float32).tiny


def _near_tie_row_ok(ref: RouterReference, row: int, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the ids `got` of one row are a correct routing once ties within a few ulp may go either way.

    Expert level: slot by slot, the reference's selection score at the chosen id is within tolerance of the score
    at the reference's id (so the same scores were picked in the same order, only near-equal ones swapped).
    Group level (grouped routers): the chosen experts lie in groups the reference keeps or in groups whose score is
    within tolerance of the last kept one, no more than topk_group groups are used, and the ids are, slot by slot
    as above, the reference selection over that set of groups.
    """
    num_experts = ref.selection.shape[1]
    if (got < 0).any() or (got >= num_experts).any() or got.unique().numel() != got.numel():
        return False
    sel, tol = ref.selection[row], _tolerance(ref.magnitude[row])

    def slotwise(expect: torch.Tensor) -> bool:
        a, b = sel[got], sel[expect]
        return bool(((a - b).abs() <= torch.maximum(tol[got], tol[expect])).all())

    if ref.group_scores is None:
        return slotwise(want)
    num_groups = ref.num_groups
    group_size = num_experts // num_groups
    gscore, gtol = ref.group_scores[row], _tolerance(ref.group_magnitude[row])
    order = select_desc_torch(gscore[None], num_groups)[0]
    last_kept = gscore[order[ref.topk_group - 1]]
    used = torch.unique(got // group_size)
    if used.numel() > ref.topk_group:
        return False
    band = gscore >= last_kept - torch.maximum(gtol, gtol[order[ref.topk_group - 1]])
    if not bool(band[used].all()):
        return False
    # the groups certainly kept (strictly above the band's edge) plus the ones this output used
    sure = gscore > last_kept + torch.maximum(gtol, gtol[order[ref.topk_group - 1]])
    keep = sure.clone()
    keep[used] = True
    if int(keep.sum()) > ref.topk_group:
        return False
    masked = torch.where(keep.repeat_interleave(group_size), sel, torch.full_like(sel, float("-inf")))
    expect = select_desc_torch(masked[None], got.numel())[0]
    return slotwise(expect)


def expected_weights(ref: RouterReference, ids: torch.Tensor) -> torch.Tensor:
    """The reference's weights for the given ids: probs gathered, renormalised, scaled; padded rows 0.0."""
    safe = ids.long().clamp(0, ref.probs.shape[1] - 1)  # -1 (padded) and out-of-range ids of wrong rows
    w = ref.probs.gather(1, safe)
    if ref.renormalize:
        w = renormalize_torch(w)
    w = w * ref.scale
    if ref.is_padding is not None:
        w = w.masked_fill(ref.is_padding[:, None], 0.0)
    return w


def compare_routing(weights: torch.Tensor, ids: torch.Tensor, ref: RouterReference, *,
                    weight_max_rel: float = 1e-5, weight_rms_rel: float = 1e-5):
    """Judge a router's (weights, ids) against the reference. Returns a CheckResult.

    ids: exact, except rows where the reference's own fp32 scores show a near-tie (`_near_tie_row_ok`): those
    are counted (`ids.near_tie_rows`), any other difference fails (`ids.bad_rows`). Padded rows must be exactly
    -1 / +0.0. Weights: max and RMS relative error against the reference's probs at the ids actually chosen.
    """
    from moebench.check import compare_close, compare_exact
    from moebench.registry import CheckResult

    shape = tuple(ref.ids.shape)
    if tuple(ids.shape) != shape or tuple(weights.shape) != shape:
        return CheckResult(False, f"output shapes {tuple(weights.shape)}/{tuple(ids.shape)} != reference {shape}",
                           {"ids.bad_rows": float("inf")})
    if ids.dtype != torch.int32 or weights.dtype != torch.float32:
        return CheckResult(False, f"dtypes {weights.dtype}/{ids.dtype}, expected float32/int32",
                           {"ids.bad_rows": float("inf")})
    ids, weights = ids.cpu(), weights.cpu()
    ref_cpu = RouterReference(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(ref).items()})
    exact = compare_exact("ids", ids, ref_cpu.ids)
    differing_rows = (ids != ref_cpu.ids).any(dim=1).nonzero().flatten().tolist()
    padded = ref_cpu.is_padding if ref_cpu.is_padding is not None else torch.zeros(shape[0], dtype=torch.bool)
    near, bad = 0, []
    for row in differing_rows:
        if not bool(padded[row]) and _near_tie_row_ok(ref_cpu, row, ids[row].long(), ref_cpu.ids[row].long()):
            near += 1
        else:
            bad.append(row)
    metrics = {"ids.mismatches": exact.metrics["ids.mismatches"], "ids.near_tie_rows": float(near),
               "ids.bad_rows": float(len(bad))}
    details = []
    if bad:
        details.append(f"ids: {len(bad)} rows wrong (first rows {bad[:5]}; {exact.detail})")
    # padded rows bit for bit: -1 and +0.0
    if padded.any():
        pad_w = weights[padded]
        if (ids[padded] != -1).any() or (pad_w.view(torch.int32) != 0).any():
            details.append("padded rows: ids must be -1 and weights +0.0")
            metrics["padded.bad_rows"] = float(((ids[padded] != -1) | (pad_w.view(torch.int32) != 0))
                                               .any(dim=1).sum())
    live = ~padded
    want_w = expected_weights(ref_cpu, ids)
    if len(bad):  # weights of wrong rows are meaningless; judge the rest
        keep = torch.ones(shape[0], dtype=torch.bool)
        keep[bad] = False
        live = live & keep
    close = compare_close("weights", weights[live], want_w[live], weight_max_rel, weight_rms_rel)
    metrics.update(close.metrics)
    if not close.ok:
        details.append(close.detail)
    ok = not details
    return CheckResult(ok, "; ".join(details), metrics)


# ---------------------------------------------------------------------------------------------------------------
# Registration (targets "router" and "kernel")
# ---------------------------------------------------------------------------------------------------------------

def router_case(p, ctx, route, reference):
    """The benchmark Case of a registered router (topk_softmax, grouped_topk) at point p.

    route(logits, *, is_padding, bias, out) runs the router into `out`; reference(logits, *, is_padding, bias)
    gives its RouterReference. Both already carry the point's other knobs (top_k, renormalize, groups, ...).
    """
    from moebench.check import poison
    from moebench.inputs import make_batch
    from moebench.registry import Case, Routing

    batch = make_batch(p, ctx.device, need_hidden=False)
    mask = batch.mask  # None when the point routes padded rows like real ones
    bias = batch.bias if p.bias else None
    num_tokens, top_k = batch.num_tokens, p.top_k
    out = router_outputs(num_tokens, top_k, ctx.device, None)

    def run():
        return route(batch.logits, is_padding=mask, bias=bias, out=out)

    def check():
        ref = reference(batch.logits, is_padding=mask, bias=bias)
        for t in out:
            poison(t)
        run()
        return compare_routing(out[0], out[1], ref)

    nbytes = batch.logits.numel() * batch.logits.element_size() + num_tokens * top_k * (4 + 4)
    note = "logits read + weights and ids written"
    if mask is not None:
        nbytes += num_tokens
        note += " + mask"
    if bias is not None:
        nbytes += bias.numel() * 4
        note += " + bias"
    return Case(run=run, check=check, bytes_moved=nbytes, bytes_note=note,
                routing=Routing(out[1], batch.is_padding, p.num_experts, p.ep_size), nvtx_stage="route")


def register_router_impls(kernel: str, variants: dict, reference, knobs, validate) -> None:
    """Register `<kernel>.<variant>` (targets router and kernel) for each variant: (router function, description).

    knobs(p) gives the point's keyword arguments shared by the router and `reference` (top_k, renormalize, ...).
    """
    from moebench.registry import Impl, register

    for variant, (route, text) in variants.items():
        def build(p, ctx, route=route):
            kwargs = knobs(p)
            return router_case(p, ctx, functools.partial(route, **kwargs), functools.partial(reference, **kwargs))

        register(Impl(f"{kernel}.{variant}", targets=("router", "kernel"), build=build, description=text,
                      validate=validate))


register_router_impls(
    "topk_softmax",
    {
        "triton": (topk_softmax, "Triton softmax top-k router: a row block per program, K iterative arg-max picks, "
                                 "is_padding rows written as -1 / 0.0 without reading their logits"),
        "torch": (topk_softmax_torch, "eager torch softmax + stable descending sort (the reference)"),
    },
    topk_softmax_reference, knobs=lambda p: dict(top_k=p.top_k, renormalize=p.renormalize),
    validate=lambda p: router_limits_problem(p.num_experts, p.top_k))
