"""Registration of the dispatch paths as timed impls (target "dispatch", one process per EP rank).

build(p, ctx) runs on every rank of ctx.group (ctx.world_size == p.ep_size): this rank's padded batch from
make_batch(p, seed_offset=rank), routed with the mask when p.mask (mask-aware: padded rows are not sent) or
without (oblivious: padded rows travel with whatever experts they picked). run() = dispatch + a cheap exact expert
(`scaled_expert`: expert e scales its rows by e + 1, weighted) + combine; the stages "dispatch" and "combine" are
exposed too. check() compares the received rows bitwise with the single-process reference computed from every
rank's gathered inputs, the combined output with what one process holding all experts computes (bf16 tolerance),
and that padded rows are never sent when masked.
"""

from __future__ import annotations

from typing import Callable

import torch

from moebench.check import compare_close, poison
from moebench.dispatch.base import (DispatchPath, EPLayout, capacity_for, check_received, count_padding_received,
                                    effective_ids, gather_inputs, max_rows_per_pair, scaled_expert,
                                    scaled_expert_reference, token_in_rank)
from moebench.registry import Case, CheckResult, Impl, Routing, RunContext, register
from moebench.sweep import Params

COMBINE_MAX_REL = 2e-2  # partial sums are rounded to bf16 on each rank before they are added
COMBINE_RMS_REL = 5e-3


def make_path(kind: str, layout: EPLayout, p: Params, num_tokens: int, device: torch.device,
              capacity: int | None = None) -> DispatchPath:
    common = dict(hidden=p.hidden, top_k=p.top_k, dtype=torch.bfloat16, device=device)
    if kind == "agrs":
        from moebench.dispatch.agrs import AGRSPath

        return AGRSPath(layout, **common)
    if kind == "a2a":
        from moebench.dispatch.a2a import A2APath

        return A2APath(layout, **common)
    if kind == "a2a_fixed":
        from moebench.dispatch.a2a_fixed import A2AFixedPath

        if capacity is None:
            raise ValueError("a2a_fixed needs a capacity")
        return A2AFixedPath(layout, num_tokens=num_tokens, capacity=capacity, **common)
    if kind == "deepep":
        from moebench.dispatch import deepep

        if p.low_latency:
            return deepep.DeepEPLowLatencyPath(layout, num_max_dispatch_tokens_per_rank=num_tokens, **common)
        return deepep.DeepEPNormalPath(layout, **common)
    if kind in ("deepep_v2", "deepep_v2_expand"):
        from moebench.dispatch import deepep

        return deepep.DeepEPV2Path(layout, num_max_tokens_per_rank=p.num_max_tokens_per_rank,
                                   do_expand=kind == "deepep_v2_expand", **common)
    raise ValueError(f"unknown dispatch path {kind!r}")


def padded_rows_sent(path: DispatchPath, ids: torch.Tensor, is_padding: torch.Tensor) -> int:
    """Padded rows this rank puts on the wire (per destination, own rank included)."""
    lay = path.layout
    if path.receives == "all":
        return int(is_padding.sum()) * lay.world_size
    if path.receives == "slot":
        return int(((ids >= 0) & is_padding.unsqueeze(1)).sum())
    return int((token_in_rank(ids, lay) & is_padding.unsqueeze(1)).sum())


def _make_build(kind: str) -> Callable[[Params, RunContext], Case]:
    def build(p: Params, ctx: RunContext) -> Case:
        from moebench import inputs

        R = ctx.world_size
        if R != p.ep_size:
            raise ValueError(f"dispatch.{kind}: ep_size {p.ep_size} needs {p.ep_size} ranks, this group has {R}")
        layout = EPLayout(ctx.rank, R, p.num_experts, ctx.group if R > 1 else None)
        batch = inputs.make_batch(p, ctx.device, seed_offset=ctx.rank)
        topk_weights, topk_ids = inputs.route(p, batch)  # -1 on padded rows when p.mask
        x, mask = batch.hidden, batch.mask
        T = x.shape[0]

        capacity, max_rows = None, None
        if kind in ("a2a_fixed", "deepep_v2", "deepep_v2_expand") and T > p.num_max_tokens_per_rank:
            raise ValueError(f"{T} rows per rank exceed num_max_tokens_per_rank={p.num_max_tokens_per_rank}")
        if kind == "a2a_fixed":
            max_rows = max_rows_per_pair(topk_ids, mask, layout)
            capacity = capacity_for(p.capacity_policy, max_rows, p.num_max_tokens_per_rank)
        path = make_path(kind, layout, p, T, ctx.device, capacity)
        out = torch.empty_like(x)

        def expert(d):
            return scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)

        def run():
            d = path.dispatch(x, topk_ids, topk_weights, mask)
            return path.combine(expert(d), d.handle, out=out)

        # One untimed round trip: compiles kernels, sizes the traffic, and feeds the combine-only stage.
        d0 = path.dispatch(x, topk_ids, topk_weights, mask)
        y0 = expert(d0)
        path.combine(y0, d0.handle, out=out)
        stats = path.stats(d0)

        def run_dispatch():
            return path.dispatch(x, topk_ids, topk_weights, mask)

        def run_combine():
            return path.combine(y0, d0.handle, out=out)

        ids_eff = effective_ids(topk_ids, mask)
        sent_padding = padded_rows_sent(path, ids_eff, batch.is_padding)

        def check() -> CheckResult:
            if kind == "a2a_fixed":
                path.fill_garbage(torch.Generator(device=ctx.device).manual_seed(p.seed + 17 + ctx.rank))
                path.reset_overflow()
            poison(out)
            d = path.dispatch(x, topk_ids, topk_weights, mask)
            path.combine(expert(d), d.handle, out=out)
            g = gather_inputs(x, topk_ids, topk_weights, batch.is_padding, mask is not None, layout)
            results = [check_received(path, d, g)]
            ref = scaled_expert_reference(x, ids_eff, topk_weights, layout.experts_per_rank)
            results.append(compare_close("combined", out, ref, COMBINE_MAX_REL, COMBINE_RMS_REL))
            pads = count_padding_received(path, d, g)
            metrics = {k: float(v) for k, v in pads.items()}
            if mask is not None:
                # agrs moves every row by construction; masked, its padded rows must carry no route
                key = "padded_routes_received" if path.receives == "all" else "padded_rows_received"
                if pads[key]:
                    results.append(CheckResult(False, f"mask-aware {kind} received {pads[key]} padded rows "
                                                      f"({key})", {}))
            if kind == "a2a_fixed" and not path.invalid_rows_clean():
                results.append(CheckResult(False, "a2a_fixed: receive rows past the counts kept live ids", {}))
            if kind == "a2a_fixed" and path.overflowed():
                results.append(CheckResult(False, f"capacity {path.capacity} overflowed (max rows per rank pair "
                                                  f"{max_rows})", {}))
            results.append(CheckResult(True, "", metrics))
            return CheckResult.merge(*results)

        info = {**stats.as_info(), "padded_rows_sent": sent_padding, "path": path.name,
                "receives": path.receives, "mask_aware": mask is not None}
        if kind == "a2a_fixed":
            info.update(capacity=capacity, capacity_policy=p.capacity_policy, max_rows_per_pair=max_rows,
                        buffer_rows=p.num_max_tokens_per_rank)
        if kind.startswith("deepep_v2"):
            info.update(num_max_tokens_per_rank=p.num_max_tokens_per_rank, do_expand=kind.endswith("expand"))
        return Case(run=run, check=check,
                    bytes_moved=stats.recv_payload_bytes + stats.combine_recv_bytes,
                    bytes_note="payload received by this rank, dispatch (hidden + ids + weights per row) + combine "
                               "(hidden per row); own-rank rows included (own share in info); wire bytes in info",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, R),
                    graph_capturable=path.graph_capturable,
                    stages=[("dispatch", run_dispatch), ("combine", run_combine)],
                    info=info, nvtx_stage="dispatch", cleanup=path.close)
    return build


def _validate(kind: str) -> Callable[[Params], str | None]:
    def validate(p: Params) -> str | None:
        if p.ep_mode == "simulated" and p.ep_size > 1:
            return "ep_mode: dispatch paths run on ep_size real processes (simulated is not supported)"
        if kind in ("a2a_fixed", "deepep_v2", "deepep_v2_expand") and p.num_tokens > p.num_max_tokens_per_rank:
            return f"num_tokens: {p.num_tokens} > num_max_tokens_per_rank {p.num_max_tokens_per_rank}"
        return None
    return validate


def _available(kind: str) -> Callable[[RunContext], str | None]:
    if not kind.startswith("deepep"):
        return lambda ctx: None

    def available(ctx: RunContext) -> str | None:
        from moebench.dispatch import deepep

        why = deepep.unavailable("v2" if kind.startswith("deepep_v2") else "legacy")
        if why:
            return why
        return None if ctx.is_cuda else "deep_ep needs CUDA GPUs"
    return available


_DESCRIPTIONS = {
    "agrs": "all-gather rows + routing, local experts on every row, reduce-scatter back",
    "a2a": "count exchange (host sync), permute by destination, exact-size all_to_all_single; scatter-sum back",
    "a2a_fixed": "fixed-capacity blocks per destination (capacity_policy), no host sync, graph-capturable; "
                 "Triton pack/combine with CAPACITY constexpr; garbage rows neutralised on receipt",
    "deepep": "DeepEP legacy Buffer: intranode normal mode, or low-latency mode with low_latency: true",
    "deepep_v2": "DeepEP V2 ElasticBuffer, do_expand=False, no CPU sync; rows past the count neutralised",
    "deepep_v2_expand": "DeepEP V2 ElasticBuffer, do_expand=True (one row per expert slot), no CPU sync",
}

for _kind, _desc in _DESCRIPTIONS.items():
    register(Impl(f"dispatch.{_kind}", targets=("dispatch",), build=_make_build(_kind), description=_desc,
                  available=_available(_kind), validate=_validate(_kind), multi_rank=True))
