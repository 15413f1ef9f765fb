"""Input staging for the DeepSeek-V4 "MegaMoE" path: per-token-group fp8 quantisation of the hidden states
plus the routing outputs as the expert kernel wants them (int64 ids, fp32 weights), padded rows masked.

docs/contracts.md "prepare_moe_inputs". One Triton launch does everything; `prepare_moe_inputs_torch` is the
reference.
The Triton kernel is bitwise equal to the reference on a GPU because both compute, in fp32 and in the same
order: amax -> max(amax, 1e-4) -> IEEE division by 448 -> (UE8M0: exponent round-up on the fp32 bits) ->
IEEE reciprocal -> one multiply -> round-to-nearest-even cast to e4m3fn.

`prepare_moe_inputs_oblivious` (also `prepare_moe_inputs.oblivious`) is the staging before the fix: the padding mask
is ignored, so padded rows keep the ids and weights their router gave them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels._details.args import check_mask
from moebench.kernels._details.jit import check_triton_device

__all__ = ["prepare_moe_inputs", "prepare_moe_inputs_torch", "prepare_moe_inputs_oblivious", "SCALE_FORMATS",
           "FP8_MAX", "AMAX_FLOOR", "output_shapes", "alloc_outputs", "check_staging_args", "stage_routing_torch"]

SCALE_FORMATS = ("ue8m0_packed", "fp32")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # keeps an all-zero group from getting a zero scale

# Launch shape (H200, memory bound): each program stages ELEMS hidden values (8 KiB of bf16) as a
# [words, 4, group] tile, 4 warps -> 32 values (4 x 16 B loads) per thread, enough bytes in flight per SM at
# ~16 resident programs. The routing part is spread over the same programs, ID_BLOCK slots each.
# `tune=(elems, warps)` launches another shape, so these can be revisited on the GPU.
DEFAULT_ELEMS_PER_PROGRAM = 4096
DEFAULT_NUM_WARPS = 4
ID_BLOCK = 128


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_staging_args(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                is_padding: torch.Tensor | None, group_size: int, scale_format: str) -> tuple[int, int, int]:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden must be bf16 (or fp16/fp32), got {hidden.dtype}")
    T, H = hidden.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, K], got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check_mask(is_padding, T)
    if is_padding is not None and is_padding.dtype != torch.bool:
        raise ValueError(f"is_padding must be bool, got {is_padding.dtype}")
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {', '.join(SCALE_FORMATS)}, got {scale_format!r}")
    if not (is_pow2(group_size) and 8 <= group_size <= 1024):
        raise ValueError(f"group_size must be a power of two in [8, 1024], got {group_size}")
    if scale_format == "ue8m0_packed" and H % (4 * group_size):
        raise ValueError(f"hidden size {H} must be a multiple of 4*group_size={4 * group_size} "
                         f"for the ue8m0_packed scale format")
    if H % group_size:
        raise ValueError(f"hidden size {H} must be a multiple of group_size={group_size}")
    return T, H, topk_ids.shape[1]


def output_shapes(num_tokens: int, hidden_size: int, top_k: int, group_size: int = 32,
                  scale_format: str = "ue8m0_packed") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each output, in the order the functions return them."""
    sf_cols = hidden_size // (4 * group_size) if scale_format == "ue8m0_packed" else hidden_size // group_size
    sf_dtype = torch.int32 if scale_format == "ue8m0_packed" else torch.float32
    return {"x_fp8": ((num_tokens, hidden_size), torch.float8_e4m3fn),
            "x_sf": ((num_tokens, sf_cols), sf_dtype),
            "topk_idx": ((num_tokens, top_k), torch.int64),
            "topk_w": ((num_tokens, top_k), torch.float32)}


def alloc_outputs(num_tokens: int, hidden_size: int, top_k: int, group_size: int = 32,
                  scale_format: str = "ue8m0_packed", device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preallocated outputs for `prepare_moe_inputs(..., out=...)` (allocate outside any timed region)."""
    shapes = output_shapes(num_tokens, hidden_size, top_k, group_size, scale_format)
    return tuple(torch.empty(s, dtype=d, device=device) for s, d in shapes.values())  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------------------
# Reference (docs/contracts.md, literally)
# ---------------------------------------------------------------------------------------------------------------

def ue8m0_round_up(sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale rounded up to a power of two, its biased exponent e as int32), from the fp32 bits of `sf` > 0."""
    bits = sf.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    e = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e = e.clamp(1, 254)
    return (e << 23).view(torch.float32), e


def pack_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """[T, G] exponent bytes -> [T, G/4] int32 words, e[4j] | e[4j+1]<<8 | e[4j+2]<<16 | e[4j+3]<<24."""
    T, G = e.shape
    e64 = e.to(torch.int64).view(T, G // 4, 4)
    word = e64[..., 0] | (e64[..., 1] << 8) | (e64[..., 2] << 16) | (e64[..., 3] << 24)
    word = torch.where(word >= 2**31, word - 2**32, word)  # the int32 whose bits these are
    return word.to(torch.int32)


def stage_routing_torch(topk_weights: torch.Tensor, topk_ids: torch.Tensor, is_padding: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64, topk_w fp32): the router outputs with padded rows set to -1 / 0.0 (new tensors)."""
    topk_idx = topk_ids.to(torch.int64, copy=True)
    topk_w = topk_weights.clone()
    if is_padding is not None:
        topk_idx.masked_fill_(is_padding[:, None], -1)
        topk_w.masked_fill_(is_padding[:, None], 0.0)
    return topk_idx, topk_w


def prepare_moe_inputs_torch(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             is_padding: torch.Tensor | None = None, group_size: int = 32,
                             scale_format: str = "ue8m0_packed"
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference: (x_fp8 [T,H] e4m3fn, x_sf, topk_idx int64 [T,K], topk_w fp32 [T,K])."""
    T, H, _ = check_staging_args(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format)
    G = group_size
    x = hidden.float().reshape(T, H // G, G)
    amax = x.abs().amax(dim=2)
    amax = amax.clamp_min(AMAX_FLOOR)
    # Divide by a device tensor, not a Python number: CUDA turns `tensor / python_scalar` into a multiply by
    # the scalar's fp32 reciprocal, which is not the IEEE quotient the contract (and the Triton kernel) computes.
    sf = amax / amax.new_full((), FP8_MAX)
    if scale_format == "ue8m0_packed":
        sf, e = ue8m0_round_up(sf)
        x_sf = pack_ue8m0(e)
    else:
        x_sf = sf
    inv = sf.new_ones(()) / sf  # IEEE reciprocal (tensor / tensor)
    x_fp8 = (x * inv.unsqueeze(2)).to(torch.float8_e4m3fn).reshape(T, H)
    topk_idx, topk_w = stage_routing_torch(topk_weights, topk_ids, is_padding)
    return x_fp8, x_sf, topk_idx, topk_w


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _prepare_moe_inputs_kernel(
    hidden_ptr,  # [T*H] contiguous, bf16/fp16/fp32
    x_fp8_ptr,  # [T*H] float8e4nv
    x_sf_ptr,  # packed: [T*H/(4G)] int32 words; fp32: [T*H/G] fp32
    topk_weights_ptr, topk_ids_ptr,  # [T*K]
    is_padding_ptr,  # [T] uint8 (only read when HAS_MASK)
    topk_idx_ptr, topk_w_ptr,  # [T*K] int64 / fp32 outputs
    num_groups,  # T*H/G
    num_routes,  # T*K
    GROUP: tl.constexpr,
    WORDS: tl.constexpr,  # 4-group words per program
    TOP_K: tl.constexpr,
    ID_BLOCK: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)

    # -- hidden states: rows are contiguous, so the [T, H/G] groups are one flat sequence; a "word" is 4
    # consecutive groups (one packed scale). Tile [WORDS, 4, GROUP]: no reshape, reductions along axes.
    # 64-bit program base (T*H may pass 2^31), 32-bit offsets inside the tile.
    first_group = pid * (WORDS * 4)
    groups_left = num_groups - first_group
    word = tl.arange(0, WORDS)
    slot = tl.arange(0, 4)
    group = word[:, None] * 4 + slot[None, :]  # [WORDS, 4] group index within the tile
    group_ok = group < groups_left
    offs = group[:, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    elem_base = first_group * GROUP
    x = tl.load(hidden_ptr + elem_base + offs, mask=group_ok[:, :, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    amax = tl.maximum(amax, 1e-4)
    sf = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # IEEE quotient, as the reference
    if PACKED:
        bits = sf.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(e, 1), 254)
        sf = (e << 23).to(tl.float32, bitcast=True)
        # Disjoint bytes, so the sum is the OR; done in int64 and truncated to the int32 bit pattern.
        packed = tl.sum(e.to(tl.int64) << (slot * 8).to(tl.int64)[None, :], axis=1)
        tl.store(x_sf_ptr + pid * WORDS + word, packed.to(tl.int32), mask=word * 4 < groups_left)
    else:
        tl.store(x_sf_ptr + first_group + group, sf, mask=group_ok)
    inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    q = x * inv[:, :, None]
    tl.store(x_fp8_ptr + elem_base + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
             mask=group_ok[:, :, None])

    # -- routing: ID_BLOCK consecutive (token, k) slots per program; most programs have none.
    first_route = pid * ID_BLOCK
    if first_route < num_routes:
        route = first_route + tl.arange(0, ID_BLOCK)
        route_ok = route < num_routes
        ids = tl.load(topk_ids_ptr + route, mask=route_ok, other=0).to(tl.int64)
        weights = tl.load(topk_weights_ptr + route, mask=route_ok, other=0.0)
        if HAS_MASK:
            padded = tl.load(is_padding_ptr + route // TOP_K, mask=route_ok, other=0) != 0
            ids = tl.where(padded, -1, ids)
            weights = tl.where(padded, 0.0, weights)
        tl.store(topk_idx_ptr + route, ids, mask=route_ok)
        tl.store(topk_w_ptr + route, weights, mask=route_ok)


def _check_out(out, shapes, device) -> tuple[torch.Tensor, ...]:
    if len(out) != 4:
        raise ValueError(f"out must be a tuple of 4 tensors (x_fp8, x_sf, topk_idx, topk_w), got {len(out)}")
    for t, (name, (shape, dtype)) in zip(out, shapes.items()):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"out {name}: expected contiguous {dtype} {shape} on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return tuple(out)


def _launch(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format, out, tune):
    T, H, K = check_staging_args(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format)
    check_triton_device(hidden, topk_weights, topk_ids, is_padding)
    shapes = output_shapes(T, H, K, group_size, scale_format)
    if out is None:
        out = alloc_outputs(T, H, K, group_size, scale_format, hidden.device)
    else:
        out = _check_out(out, shapes, hidden.device)
    if T == 0:
        return out
    x_fp8, x_sf, topk_idx, topk_w = out
    elems, num_warps = tune if tune is not None else (DEFAULT_ELEMS_PER_PROGRAM, DEFAULT_NUM_WARPS)
    words = max(1, elems // (4 * group_size))
    num_groups = T * H // group_size
    grid = (max(triton.cdiv(num_groups, 4 * words), triton.cdiv(T * K, ID_BLOCK)),)
    mask_arg = is_padding.view(torch.uint8) if is_padding is not None else topk_w  # dummy, never read
    _prepare_moe_inputs_kernel[grid](
        hidden.contiguous(), x_fp8, x_sf, topk_weights.contiguous(), topk_ids.contiguous(), mask_arg,
        topk_idx, topk_w, num_groups, T * K,
        GROUP=group_size, WORDS=words, TOP_K=K, ID_BLOCK=ID_BLOCK,
        PACKED=scale_format == "ue8m0_packed", HAS_MASK=is_padding is not None, num_warps=num_warps,
    )
    return out


def prepare_moe_inputs(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       is_padding: torch.Tensor | None = None, group_size: int = 32,
                       scale_format: str = "ue8m0_packed", *,
                       out: tuple[torch.Tensor, ...] | None = None, tune: tuple[int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton staging (docs/contracts.md): (x_fp8, x_sf, topk_idx int64, topk_w fp32); padded rows get -1 / 0.0.

    out: preallocated (x_fp8, x_sf, topk_idx, topk_w) (see `alloc_outputs`), written and returned.
    tune: (hidden values per program, num_warps), for tuning scripts only.
    """
    return _launch(hidden, topk_weights, topk_ids, is_padding, group_size, scale_format, out, tune)


def prepare_moe_inputs_oblivious(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                 is_padding: torch.Tensor | None = None, group_size: int = 32,
                                 scale_format: str = "ue8m0_packed", *,
                                 out: tuple[torch.Tensor, ...] | None = None, tune: tuple[int, int] | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The staging before the fix: same kernel, `is_padding` ignored (padded rows keep their router ids)."""
    return _launch(hidden, topk_weights, topk_ids, None, group_size, scale_format, out, tune)


prepare_moe_inputs.oblivious = prepare_moe_inputs_oblivious  # type: ignore[attr-defined]
