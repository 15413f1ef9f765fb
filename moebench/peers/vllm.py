"""vLLM's kernels as peers (library "vllm"), each checked against moebench's reference before it is timed.

Sources read (vllm-project/vllm): csrc/moe/moe_align_sum_kernels.cu at 1377b4e0 (and at 00e6fb6d, before the
expert_map argument), csrc/libtorch_stable/moe/moe_align_sum_kernels.cu at 76f957b3, csrc/libtorch_stable/moe/
torch_bindings.cpp at fb73c465 (op schemas). What the adapters rely on:

  topk_softmax.vllm          ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output
                             [, renormalize][, e_score_correction_bias | bias][, is_padding]). Recent versions take a
                             selection bias (softmax + bias picks, the unbiased probability is the weight): passed
                             where the signature has it, bias points refused where it has none. `is_padding` passed
                             where taken; otherwise the padded rows are set to -1 / 0.0 after the call (inside the
                             timed region: that is what a caller of such a version must do). `renormalize` likewise.
                             Older csrc/moe/topk_softmax_kernels.cu (0112cf23) takes fp32 gating only ("expected
                             scalar type Float"): bf16 logits are then cast to fp32 before the
                             call (timed), as vLLM's fused_topk of that time did; info "vllm_topk_softmax_gating".
  grouped_topk.vllm          ops.grouped_topk(scores, num_expert_group, topk_group, topk, renormalize,
                             routed_scaling_factor, bias, scoring_func): the fused noaux_tc kernel, which always
                             scores groups by their top-2 sum with the bias, so points without bias are refused;
                             softmax scoring hands it softmax(logits) with scoring_func=0 (no activation), sigmoid
                             the logits with scoring_func=1. It returns new tensors: the copy into the caller's
                             buffers and the masking of padded rows after the call are timed (said in the record).
  moe_align_block_size.vllm  ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids,
                             experts_ids, num_tokens_post_pad[, expert_map]). No kernel of it skips -1: a negative
                             id indexes before its counting buffers. The two-block kernel (routes >= 1024 or more
                             than 64 experts) skips ids >= num_experts, so masked routes are handed as num_experts
                             (torch.where, timed). The one-block small-batch kernel checks no id range at all; it
                             skips only routes the expert_map sends to -1, so there masked routes are handed as a
                             global expert the map does not own, and without a point map as id E through an
                             (E + 1)-entry identity map whose last entry is -1 (built once, untimed; num_experts =
                             E + 1). With an expert_map vLLM takes the global expert count and writes local ids.
                             Without the expert_map argument (older versions) the map is applied before (torch,
                             timed), and a small-batch point with skipped routes is refused when it runs. The record
                             says which kernel and which sentinel (info "vllm_align_kernel", "vllm_align_sentinel").
                             Judged after moebench.bench.align.canonical_alignment (route order within an expert's
                             blocks is free).
  masked_moe_sum.vllm        ops.moe_sum(input, output): adds every slot (no mask), so it is judged like
                             masked_moe_sum.oblivious (against the all-slots sum) and recorded mask_aware=False.
                             csrc/moe (1377b4e0): kernels for top_k 2, 3 and 4 only, whose running sum is the input
                             dtype (bf16); any other top_k runs torch's at::sum_out, not a vLLM kernel. The record's
                             info "moe_sum_path" says which by that rule; newer sources (libtorch_stable at
                             76f957b3) sum in fp32 for every top_k. Judged by the bf16-accumulation precision class
                             (within top_k / 2 bf16 ulps of sum(|x_k|) of the fp32 sum), flagged in info
                             "precision", with the observed class in info "accumulation".
Its fused_experts peers (bf16 and fp8 block-scaled) are in peers.vllm_experts, on the same Library.

None of these has been run against a real vLLM by moebench's tests: they run against tests/standins/vllm_ops.py,
a stand-in with these call signatures that raises where the real kernels read or write out of bounds.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from moebench.bench.align import align_build_for
from moebench.bench.moe_sum import oblivious_build_for
from moebench.kernels.apply_expert_map import apply_expert_map_torch
from moebench.peers._lib import Library, accepts, register_adapter, router_after, router_out, scratch_like


def _optional(ns: SimpleNamespace, module: str, *names: str) -> None:
    """Copy `names` of `module` onto ns where this vLLM has them (versions move and drop helpers)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    for name in names:
        if hasattr(mod, name):
            setattr(ns, name, getattr(mod, name))


def _load():
    from vllm import _custom_ops as ops

    ns = SimpleNamespace(**{n: getattr(ops, n) for n in ("topk_softmax", "grouped_topk", "moe_align_block_size",
                                                         "moe_sum") if hasattr(ops, n)})
    fused_moe = "vllm.model_executor.layers.fused_moe"
    _optional(ns, fused_moe, "fused_experts")
    _optional(ns, f"{fused_moe}.fused_moe", "get_config_file_name", "get_moe_configs", "try_get_optimal_moe_config")
    _optional(ns, f"{fused_moe}.config", "fp8_w8a8_moe_quant_config")
    _optional(ns, "vllm.model_executor.layers.quantization.utils.fp8_utils", "per_token_group_quant_fp8")
    _optional(ns, "vllm.envs", "VLLM_FUSED_MOE_CHUNK_SIZE")
    return ns


VLLM = Library("vllm", "vllm", _load)


def make_topk_softmax(lib):
    op = lib.topk_softmax
    takes_renorm, takes_pad = accepts(op, "renormalize"), accepts(op, "is_padding")
    bias_arg = topk_softmax_bias_arg(op)
    scratch: dict = {}
    fp32_gating_only: set = set()

    def fn(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        indices = scratch_like(scratch, ids)
        kw = {}
        if takes_renorm:
            kw["renormalize"] = bool(renormalize)
        if takes_pad and is_padding is not None:
            kw["is_padding"] = is_padding
        if bias is not None:  # validate refuses bias points where the signature has no bias argument
            kw[bias_arg] = bias
        gating = logits.float() if logits.dtype in fp32_gating_only else logits
        try:
            op(weights, ids, indices, gating, **kw)
        except RuntimeError as e:
            # Versions before bf16 gating check `gating_output` is fp32; their own caller (fused_topk) handed
            # them gating_output.float(), so the adapter does the same (timed) and says so. Found on the first,
            # untimed call; any other error is the kernel's.
            if gating is not logits or "expected scalar type Float" not in str(e):
                raise
            fp32_gating_only.add(logits.dtype)
            fn.info["vllm_topk_softmax_gating"] = (f"fp32 only in this version: {logits.dtype} logits cast to "
                                                   "fp32 before the call (timed), as vLLM's fused_topk did")
            op(weights, ids, indices, logits.float(), **kw)
        return router_after(weights, ids, None if takes_pad else is_padding,
                            renormalize=renormalize and not takes_renorm)
    fn.info = {}
    return fn


def topk_softmax_bias_arg(op) -> str | None:
    """The name of topk_softmax's selection-bias argument in this version, or None."""
    return next((n for n in ("e_score_correction_bias", "bias") if accepts(op, n)), None)


def make_grouped_topk(lib):
    op = lib.grouped_topk
    cast_bias: dict = {}

    def fn(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None, renormalize=True,
           routed_scaling_factor=1.0, is_padding=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else logits
        if bias is not None and bias.dtype != scores.dtype:
            # The kernel reads the bias as the scores' dtype, with no cast of its own: cast once (the first,
            # untimed call), as a caller holding the bias in the model's dtype would.
            key = (bias.data_ptr(), scores.dtype)
            if key not in cast_bias:
                cast_bias[key] = bias.to(scores.dtype)
                fn.info["vllm_grouped_topk_bias"] = f"bias cast once to {scores.dtype} (untimed)"
            bias = cast_bias[key]
        w, i = op(scores, num_expert_group, topk_group, top_k, bool(renormalize), float(routed_scaling_factor),
                  bias, 0 if scoring == "softmax" else 1)
        return router_after(weights, ids, is_padding, new=(w, i))
    fn.info = {"vllm_grouped_topk": "returns new tensors: their copy into the caller's buffers and the masking of "
                                    "padded rows are timed with the kernel"}
    return fn


SMALL_BATCH_ROUTES, SMALL_BATCH_EXPERTS = 1024, 64  # vLLM's one-block alignment: routes below, experts up to


def small_batch_align(num_routes: int, num_experts: int) -> bool:
    """Whether vLLM's moe_align_block_size takes its small-batch kernel, which checks no id range."""
    return num_routes < SMALL_BATCH_ROUTES and num_experts <= SMALL_BATCH_EXPERTS


def _align_plan(topk_ids, num_experts, expert_map, takes_map):
    """(num_experts argument, expert_map argument or None, sentinel for skipped routes, map applied before the call,
    notes for the record). Called on the first (untimed) call: it may look at the map on the host."""
    routes = topk_ids.numel()
    if expert_map is not None and takes_map:
        count = expert_map.numel()  # vLLM takes the global expert count with a map
        if not small_batch_align(routes, count):
            return count, expert_map, count, False, ("two-block", "num_experts (skipped before the map)")
        unowned = (expert_map < 0).nonzero()
        if unowned.numel() == 0:
            raise ValueError("vLLM's small-batch alignment skips only experts the map sends to -1; this map owns all")
        sentinel = int(unowned[-1])
        return count, expert_map, sentinel, False, ("small-batch", f"global expert {sentinel} (expert_map -1)")
    if expert_map is None and small_batch_align(routes, num_experts):
        if not takes_map:
            return num_experts, None, None, False, ("small-batch", "none (this vLLM takes no expert_map)")
        extended = torch.cat([torch.arange(num_experts, dtype=torch.int32, device=topk_ids.device),
                              torch.full((1,), -1, dtype=torch.int32, device=topk_ids.device)])
        kernel = "small-batch" if small_batch_align(routes, num_experts + 1) else "two-block"
        return (num_experts + 1, extended, num_experts, False,
                (kernel, f"{num_experts} through an identity expert_map of {num_experts + 1} with -1 last"))
    mapped = expert_map is not None  # a map but no expert_map argument: applied in torch before the call
    if small_batch_align(routes, num_experts):
        return num_experts, None, None, mapped, ("small-batch", "none (this vLLM takes no expert_map)")
    return num_experts, None, num_experts, mapped, ("two-block", "num_experts")


def make_align(lib):
    op = lib.moe_align_block_size
    takes_map = accepts(op, "expert_map") or accepts(op, "maybe_expert_map")
    plans: dict = {}

    def fn(topk_ids, num_experts, block_size, expert_map=None, *, out=None, workspace=None):
        sorted_ids, expert_ids, num_post = out
        key = (tuple(topk_ids.shape), num_experts, block_size, topk_ids.device, expert_map is not None)
        first = key not in plans
        if first:
            plans[key] = _align_plan(topk_ids, num_experts, expert_map, takes_map)
            kernel, sentinel = plans[key][4]
            fn.info.update(vllm_align_kernel=kernel, vllm_align_sentinel=sentinel)
        count, map_arg, sentinel, map_first, _ = plans[key]
        ids = apply_expert_map_torch(topk_ids, expert_map).to(torch.int32) if map_first else topk_ids
        if sentinel is not None:
            ids = torch.where(ids < 0, torch.full_like(ids, sentinel), ids)  # timed: vLLM reads no -1
        elif first and bool((ids < 0).any()):  # the untimed first call; the timed calls see the same ids
            raise ValueError("vLLM's small-batch alignment skips no id and this version takes no expert_map: "
                             "skipped routes cannot be handed to it")
        kw = {} if map_arg is None else {"expert_map": map_arg}
        op(ids, count, block_size, sorted_ids, expert_ids, num_post, **kw)
        return sorted_ids, expert_ids, num_post
    fn.info = {}
    return fn


MOE_SUM_KERNEL_TOPK = (2, 3, 4)  # csrc/moe/moe_align_sum_kernels.cu: the top_k with a kernel; others: at::sum_out


def make_moe_sum(lib):
    op = lib.moe_sum

    def fn(intermediate, out=None):
        if "moe_sum_path" not in fn.info:  # the first, untimed call
            top_k = intermediate.shape[1]
            fn.info["moe_sum_path"] = (f"moe_sum_kernel<topk={top_k}> (csrc/moe rule)" if top_k in MOE_SUM_KERNEL_TOPK
                                       else "torch at::sum_out fallback, not a vLLM kernel (csrc/moe rule)")
        op(intermediate, out)
        return out
    fn.info = {}
    return fn


def _bias_taken(p):
    lib = VLLM.get()
    if not p.bias or lib is None or not hasattr(lib, "topk_softmax"):
        return None  # no library: available() says why
    if topk_softmax_bias_arg(lib.topk_softmax) is None:
        return "bias: this vLLM's topk_softmax takes no selection bias (e_score_correction_bias)"
    return None


def _needs_bias(p):
    if not p.bias:
        return "bias: vLLM's fused grouped_topk always scores groups with the bias (noaux_tc); set bias: true"
    return None


register_adapter(VLLM, "topk_softmax", "vllm", "topk_softmax", make_topk_softmax,
                 "vLLM ops.topk_softmax (bias and is_padding where the installed version has them, else masked "
                 "after)", validate=_bias_taken)
register_adapter(VLLM, "grouped_topk", "vllm", "grouped_topk", make_grouped_topk,
                 "vLLM ops.grouped_topk, the fused noaux_tc router (bias required); its new tensors copied into the "
                 "buffers and padded rows masked after (timed)",
                 validate=_needs_bias)
register_adapter(VLLM, "moe_align_block_size", "vllm", "moe_align_block_size", make_align,
                 "vLLM ops.moe_align_block_size, skipped routes handed as an id its kernel skips (timed), judged in "
                 "moebench's layout (canonical_alignment)",
                 build_for=lambda fn: align_build_for(fn, canonical=True))
register_adapter(VLLM, "masked_moe_sum", "vllm", "moe_sum", make_moe_sum,
                 "vLLM ops.moe_sum: adds every slot (no mask), judged like the oblivious twin by the bf16-accumulation "
                 "precision class; kernels for top_k 2-4, torch sum_out otherwise",
                 build_for=lambda fn: oblivious_build_for(fn, input_dtype_accumulation=True), mask_aware=False)
