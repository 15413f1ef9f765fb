"""The routers' bench family: topk_softmax and grouped_topk (targets "router" and "kernel", NVTX stage "route").

Also here: `RouterReference` and `compare_routing`, the check every router case (and the layer's route stage)
runs: ids exact, near-ties only where the reference's own scores show one, weights against the reference's
scores at the chosen ids.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moebench.check import CheckResult, compare_close, compare_exact, poison
from moebench.families import KernelFamily, register_family
from moebench.inputs import make_batch
from moebench.kernels.contract import renormalize_torch, select_desc_torch
from moebench.kernels.grouped_topk import (
    grouped_args_problem,
    grouped_choice,
    grouped_topk,
    grouped_topk_scores_torch,
    grouped_topk_torch,
)
from moebench.kernels.topk_softmax import (
    router_limits_problem,
    router_outputs,
    softmax_choice,
    topk_softmax,
    topk_softmax_scores_torch,
    topk_softmax_torch,
)
from moebench.measure.cost import PointWork, router_programs, router_work
from moebench.registry import Case, Routing, register_impl, declare_work

__all__ = ["RouterReference", "topk_softmax_reference", "grouped_topk_reference", "compare_routing",
           "expected_weights", "NEAR_TIE_ULPS", "router_case"]

# ---------------------------------------------------------------------------------------------------------------
# Checking a router's output against the reference
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


def grouped_topk_reference(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None,
                           renormalize=True, routed_scaling_factor=1.0, is_padding=None) -> RouterReference:
    weights, ids = grouped_topk_torch(logits, top_k, num_expert_group, topk_group, scoring=scoring, bias=bias,
                                      renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
                                      is_padding=is_padding)
    s, b, group_scores = grouped_topk_scores_torch(logits, num_expert_group, scoring, bias)
    magnitude = s.abs() + (bias.float().abs() if bias is not None else 0.0)
    per_group = magnitude.view(magnitude.shape[0], num_expert_group, -1).amax(dim=-1)
    group_magnitude = 2 * per_group if bias is not None else per_group  # a top-2 sum vs a max
    return RouterReference(weights, ids, s, b, magnitude, renormalize, routed_scaling_factor, is_padding,
                           group_scores=group_scores, group_magnitude=group_magnitude, topk_group=topk_group)


def tie_tolerance(magnitude: torch.Tensor) -> torch.Tensor:
    return magnitude * (NEAR_TIE_ULPS * torch.finfo(torch.float32).eps) + torch.finfo(torch.float32).tiny


def near_tie_row_ok(ref: RouterReference, row: int, got: torch.Tensor, want: torch.Tensor) -> bool:
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
    sel, tol = ref.selection[row], tie_tolerance(ref.magnitude[row])

    def slotwise(expect: torch.Tensor) -> bool:
        a, b = sel[got], sel[expect]
        return bool(((a - b).abs() <= torch.maximum(tol[got], tol[expect])).all())

    if ref.group_scores is None:
        return slotwise(want)
    num_groups = ref.num_groups
    group_size = num_experts // num_groups
    gscore, gtol = ref.group_scores[row], tie_tolerance(ref.group_magnitude[row])
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

    ids: exact, except rows where the reference's own fp32 scores show a near-tie (`near_tie_row_ok`): those
    are counted (`ids.near_tie_rows`), any other difference fails (`ids.bad_rows`). Padded rows must be exactly
    -1 / +0.0. Weights: max and RMS relative error against the reference's probs at the ids actually chosen.
    """
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
        if not bool(padded[row]) and near_tie_row_ok(ref_cpu, row, ids[row].long(), ref_cpu.ids[row].long()):
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
# Cases and registration (targets "router" and "kernel")
# ---------------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------------
# Registration (targets "router" and "kernel")
# ---------------------------------------------------------------------------------------------------------------

def router_case(p, ctx, route, reference):
    """The benchmark Case of a registered router (topk_softmax, grouped_topk) at point p.

    route(logits, *, is_padding, bias, out) runs the router into `out`; reference(logits, *, is_padding, bias)
    gives its RouterReference. Both already carry the point's other knobs (top_k, renormalize, groups, ...).
    """
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
        weights, ids = run()  # what the router returns is judged (an outside router may ignore `out`)
        return compare_routing(weights, ids, ref)

    nbytes = batch.logits.numel() * batch.logits.element_size() + num_tokens * top_k * (4 + 4)
    note = "logits read + weights and ids written"
    if mask is not None:
        nbytes += num_tokens
        note += " + mask"
    if bias is not None:
        nbytes += bias.numel() * 4
        note += " + bias"
    def returned_ids():  # the imbalance of what the router returns, after the timing (not of `out`)
        return run()[1]

    return Case(run=run, check=check, bytes_moved=nbytes, bytes_note=note,
                routing=Routing(returned_ids, batch.is_padding, p.num_experts, p.ep_size), nvtx_stage="route")


def router_build_for(reference, knobs):
    """build_for(route) of a router family: the case of `route` called like moebench's own router."""
    def build_for(route):
        def build(p, ctx):
            kwargs = knobs(p)
            choice = TRITON_ROUTERS.get(route)
            route_kwargs = dict(kwargs, config=p.config) if choice is not None else kwargs
            case = router_case(p, ctx, functools.partial(route, **route_kwargs),
                               functools.partial(reference, **kwargs))
            if choice is not None:  # the launch the router takes at the batch's real row count, recorded
                case.info.update(choice(p, case.routing.is_padding.shape[0], ctx.device).record())
            return case
        return build
    return build_for


# the Triton routers, with the function naming the launch config each takes at a point (their `config=`)
TRITON_ROUTERS = {
    topk_softmax: lambda p, rows, device: softmax_choice(rows, p.num_experts, p.top_k, device, p.config),
    grouped_topk: lambda p, rows, device: grouped_choice(rows, p.num_experts, p.top_k, p.num_expert_group, device,
                                                         p.config),
}


def register_router_impls(kernel: str, variants: dict, reference, knobs, validate, baseline: str, call: str) -> None:
    """Register `<kernel>.<variant>` (targets router and kernel) for each variant: (router function, description),
    and the kernel family (moebench.families) outside routers are benchmarked through.

    knobs(p) gives the point's keyword arguments shared by the router and `reference` (top_k, renormalize, ...);
    `baseline` names the variant that is the family's reference.
    """
    build_for = router_build_for(reference, knobs)
    register_family(KernelFamily(kernel, ("router", "kernel"), build_for, call, validate))
    for variant, (route, text) in variants.items():
        register_impl(f"{kernel}.{variant}", targets=("router", "kernel"), description=text, validate=validate,
                      baseline=variant == baseline, tuned_kernel=kernel if route in TRITON_ROUTERS else None)(
            build_for(route))


register_router_impls(
    "topk_softmax",
    {
        "triton": (topk_softmax, "Triton softmax top-k router: a row block per program, K iterative arg-max picks, "
                                 "is_padding rows written as -1 / 0.0 without reading their logits"),
        "torch": (topk_softmax_torch, "eager torch softmax + stable descending sort (the reference)"),
    },
    topk_softmax_reference, knobs=lambda p: dict(top_k=p.top_k, renormalize=p.renormalize),
    validate=lambda p: router_limits_problem(p.num_experts, p.top_k), baseline="torch",
    call="fn(logits, top_k=, renormalize=, is_padding=mask or None, bias=fp32 [E] or None, out=(weights, ids)) "
         "-> (weights fp32 [T,K], ids int32 [T,K]); padded rows -1 / +0.0")


def grouped_validate(p) -> str | None:
    """Why a point is impossible for the grouped router, or None."""
    return router_limits_problem(p.num_experts, p.top_k) or grouped_args_problem(
        p.num_experts, p.top_k, p.num_expert_group, p.topk_group, p.scoring, p.bias)


register_router_impls(
    "grouped_topk",
    {
        "triton": (grouped_topk, "Triton grouped router (softmax|sigmoid, bias, top-2 group scores): [group, row, "
                                 "member] tile, iterative group and expert picks, is_padding rows written as -1 / 0.0"),
        "torch": (grouped_topk_torch, "eager torch grouped top-k with stable descending sorts (the reference)"),
    },
    grouped_topk_reference,
    knobs=lambda p: dict(top_k=p.top_k, num_expert_group=p.num_expert_group, topk_group=p.topk_group,
                         scoring=p.scoring, renormalize=p.renormalize, routed_scaling_factor=p.routed_scaling_factor),
    validate=grouped_validate, baseline="torch",
    call="fn(logits, top_k=, num_expert_group=, topk_group=, scoring=, renormalize=, routed_scaling_factor=, "
         "is_padding=mask or None, bias=fp32 [E] or None, out=(weights, ids)) -> (weights fp32 [T,K], ids int32 "
         "[T,K]); padded rows -1 / +0.0")
declare_work("topk_softmax", PointWork(call=router_work, programs=router_programs))
# the group scores first, then the expert picks: a fixed part and the picks over every expert per row
declare_work("grouped_topk", PointWork(call=router_work,
                                       programs=lambda p: 8 + p.num_tokens * p.num_experts * p.top_k / 1000))
