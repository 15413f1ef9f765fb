"""torch.compile peers: `<family>.compile` is torch.compile of the plain-torch formulation a user would write
(softmax + topk + masked_fill, not the stable-sort reference), benchmarked through the family's own case
(moebench.families), so it gets the same inputs, check, bytes and routing as moebench's kernels.

Each build compiles afresh for its shape (torch._dynamo.reset(), then torch.compile(dynamic=False)) and runs the
case once outside any timed region; that first call's wall time is `info["compile_seconds"]` (inductor's on-disk
cache can make a repeated shape quicker), never part of the samples. The impls are peers (`library="torch.compile"`).
Families left out: moe_align_block_size and fused_experts (their plain-torch forms are the references
themselves, or a per-expert loop that compiles per routing), and the layer (each of its stages is a family here).
"""

from __future__ import annotations

import shutil
import time

import torch

# the families these peers are built through register at the import of their bench modules
import moebench.bench.expert_ids  # noqa: F401
import moebench.bench.moe_sum  # noqa: F401
import moebench.bench.routers  # noqa: F401
import moebench.bench.staging  # noqa: F401
from moebench.families import get_family
from moebench.registry import declare_work, declared_work, register_impl

LIBRARY = "torch.compile"


# ---------------------------------------------------------------------------------------------------------------
# The formulations (what a serving engineer writes in plain torch), with moebench's signatures
# ---------------------------------------------------------------------------------------------------------------

def _write(out, *values):
    if out is None:
        return values
    for o, v in zip(out, values):
        o.copy_(v)
    return tuple(out)


def _mask_rows(weights, ids, is_padding):
    if is_padding is None:
        return weights, ids
    pad = is_padding[:, None]
    return weights.masked_fill(pad, 0.0), ids.masked_fill(pad, -1)


def topk_softmax_user(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
    probs = torch.softmax(logits.float(), dim=-1)
    selection = probs + bias if bias is not None else probs
    ids = torch.topk(selection, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights, ids = _mask_rows(weights, ids.to(torch.int32), is_padding)
    return _write(out, weights, ids)


def grouped_topk_user(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None, renormalize=True,
                      routed_scaling_factor=1.0, is_padding=None, *, out=None):
    # DeepSeek-V3's grouped (noaux_tc) routing as its modelling code writes it, -inf for the dropped groups
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    selection = scores + bias if bias is not None else scores
    grouped = selection.view(num_tokens, num_expert_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if bias is not None else grouped.amax(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_expert_group).reshape(num_tokens, -1)
    ids = torch.topk(selection.masked_fill(expert_mask == 0, float("-inf")), top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    weights, ids = _mask_rows(weights, ids.to(torch.int32), is_padding)
    return _write(out, weights, ids)


def prepare_moe_inputs_user(hidden, topk_weights, topk_ids, is_padding=None, group_size=32,
                            scale_format="ue8m0_packed", *, out=None, tune=None):
    num_tokens, hidden_size = hidden.shape
    x = hidden.float().view(num_tokens, hidden_size // group_size, group_size)
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    scale = amax / 448.0
    if scale_format == "ue8m0_packed":
        exponent = torch.ceil(torch.log2(scale))  # a power-of-two scale, rounded up (DeepGEMM's ceil_to_ue8m0)
        scale = torch.exp2(exponent)
        e = (exponent + 127).to(torch.int64).view(num_tokens, -1, 4)
        word = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
        x_sf = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    else:
        x_sf = scale
    x_fp8 = (x * (1.0 / scale).unsqueeze(-1)).to(torch.float8_e4m3fn).view(num_tokens, hidden_size)
    topk_idx, topk_w = topk_ids.to(torch.int64), topk_weights
    if is_padding is not None:
        topk_idx = topk_idx.masked_fill(is_padding[:, None], -1)
        topk_w = topk_w.masked_fill(is_padding[:, None], 0.0)
    return _write(out, x_fp8, x_sf, topk_idx, topk_w)


def apply_expert_map_user(topk_ids, expert_map, *, out=None):
    ids = topk_ids.long()
    local = torch.where(ids >= 0, expert_map.long()[ids.clamp_min(0)], -1)
    return _write(None if out is None else (out,), local)[0]


def globalize_recv_topk_idx_user(recv_topk_idx, num_recv, rank_expert_offset, num_experts):
    g = recv_topk_idx + rank_expert_offset
    row = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device)[:, None]
    keep = (recv_topk_idx >= 0) & (g < num_experts) & (row < num_recv)
    recv_topk_idx.copy_(torch.where(keep, g, -1))
    return recv_topk_idx


def masked_moe_sum_user(intermediate, topk_ids, out=None, *, launch=None):
    summed = intermediate.masked_fill((topk_ids < 0)[..., None], 0).sum(dim=1)
    return _write(None if out is None else (out,), summed)[0]


FORMULATIONS = {
    "topk_softmax": (topk_softmax_user, "softmax -> topk -> gather (+renormalize) -> masked_fill of padded rows"),
    "grouped_topk": (grouped_topk_user, "DeepSeek-V3 grouped routing: group scores, group topk, -inf mask, topk"),
    "prepare_moe_inputs": (prepare_moe_inputs_user, "per-group amax/448, ceil-log2 UE8M0 scale, fp8 cast, masked "
                                                    "ids/weights"),
    "apply_expert_map": (apply_expert_map_user, "where(id >= 0, expert_map[id], -1)"),
    "globalize_recv_topk_idx": (globalize_recv_topk_idx_user, "where(valid & row < num_recv, id + offset, -1), "
                                                              "in place"),
    "masked_moe_sum": (masked_moe_sum_user, "masked_fill(id < 0, 0).sum(dim=1)"),
}


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

def compile_available(ctx) -> str | None:
    """None where torch.compile (inductor) can build here, else why not."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if ctx.is_cuda:
        try:
            import triton  # noqa: F401  (inductor's GPU code generator)
        except ImportError:
            return "torch.compile on CUDA needs triton"
        return None
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "torch.compile on the CPU needs a C++ compiler (g++/clang++)"
    return None


def compile_build(family_name: str, formulation):
    family = get_family(family_name)

    def build(p, ctx):
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no cache from another point
        compiled = torch.compile(formulation, dynamic=False)
        case = family.build_for(compiled)(p, ctx)
        start = time.perf_counter()
        case.run()  # compiles outside the timed region
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        case.info["compile_seconds"] = round(time.perf_counter() - start, 3)
        return case
    return build


for _family, (_fn, _text) in FORMULATIONS.items():
    _fam = get_family(_family)
    register_impl(f"{_family}.compile", targets=_fam.targets, description=f"torch.compile of the plain formulation: "
                  f"{_text}", available=compile_available, validate=_fam.validate,
                  library=LIBRARY)(compile_build(_family, _fn))
    declare_work(f"{_family}.compile", declared_work(_family).with_compiles(1))  # the family's call, compiled
