"""A worst-case receive buffer through the experts: what rows past `num_recv` do downstream (seed 003).

A no-host-sync dispatch (DeepEP V2 with do_expand=False, moebench's a2a_fixed) hands the expert backend a
receive buffer of `capacity` rows of which only the first `num_recv` were written; the rest hold stale memory,
ids that look valid included. An expert backend that builds its per-expert lists by scanning every row
(vLLM's triton_unfused) computes those stale rows as if they had been received.

  recv_experts.triton     the fix: globalize_recv_topk_idx (rows >= num_recv and bad ids -> -1) before the experts.
  recv_experts.oblivious  before the fix: only `where(id >= 0, id + offset, -1)`; the stale rows keep their ids.

Both then run fused_experts (Triton) over all `capacity` rows, as the backend does. This rank is the last EP rank;
it receives, as local ids, every row with at least one of its experts (the globalize_recv_topk_idx point's
buffer, same seeds). The ids are validated against the rank's own E/R experts with offset 0, as a2a_fixed calls
the kernel (ids made global for an expert map behave the same way). The stale rows hold random hidden states and
top-k weights (old activations).

The timed region is the whole receive side: restore the buffer as dispatch left it, neutralise, experts.
info: num_recv, capacity, polluted_routes (stale rows' slots the experts' lists took in), computed_routes,
wrong_output_rows (rows of the expert output that differ, bit for bit, from the fixed path's: stale rows computed
into garbage), stale_rows.
"""

from __future__ import annotations

import torch

from moebench.bench.experts import interpreted_reduce_block_h
from moebench.dispatch.pack import CapacityKnobs
from moebench.params import EPLayout, Params
from moebench.measure.cost import PointWork, expected_expert_work, fused_experts_programs
from moebench.registry import Case, CheckResult, Routing, RunContext, register_impl, declare_work

STALE_SEED_SALT = 31  # the stale rows' contents draw from their own stream


def _available(ctx: RunContext) -> str | None:
    from moebench.kernels.runtime import interpreting

    if ctx.is_cuda or interpreting():
        return None
    return "Triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"


def _received(p: Params, ctx: RunContext):
    """This rank's receive buffer as dispatch leaves it: (ids [C, K] int64, x [C, H] bf16, weights [C, K] fp32,
    num_recv int32 [1], the point's routing and mask for the imbalance figures)."""
    from moebench.bench.expert_ids import make_receive_buffer
    from moebench.inputs import generator, make_batch, route

    dev = ctx.device
    batch = make_batch(p, dev)
    topk_weights, topk_ids = route(p, batch)
    layout = EPLayout.of(p, rank=p.ep_size - 1)  # the last rank, as the globalize_recv_topk_idx point
    local_experts, offset = layout.local_experts, layout.expert_offset
    ids = topk_ids.to(torch.int64)
    is_local = (ids >= offset) & (ids < offset + local_experts)
    rows = is_local.any(dim=1).nonzero(as_tuple=True)[0]  # host sync: build time only
    local_ids = torch.where(is_local, ids - offset, torch.full_like(ids, -1))[rows]
    capacity = max(p.knobs(CapacityKnobs).num_max_tokens_per_rank, int(rows.numel()))
    # same generator seed as the globalize_recv_topk_idx point: the same stale ids
    recv_ids, num_recv = make_receive_buffer(local_ids, capacity, local_experts,
                                             generator=generator(p.seed + 29, "cpu"))
    g = generator(p.seed * 1_000_003 + STALE_SEED_SALT, dev)
    x = torch.randn(capacity, p.hidden, generator=g, device=dev).to(torch.bfloat16)
    x[:rows.numel()] = batch.hidden[rows]
    weights = torch.rand(capacity, p.top_k, generator=g, device=dev)
    weights[:rows.numel()] = torch.where(is_local[rows], topk_weights[rows].float(), torch.zeros_like(weights[:1]))
    return recv_ids, x, weights.contiguous(), num_recv, Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size)


def _build(p: Params, ctx: RunContext, fixed: bool) -> Case:
    from moebench.bench.experts import check_experts_out
    from moebench.check import poison
    from moebench.inputs.weights import make_expert_weights
    from moebench.kernels.fused_experts import fused_experts, make_workspace
    from moebench.kernels.globalize_recv_topk_idx import (
        globalize_oblivious_reference,
        globalize_recv_topk_idx,
        globalize_recv_topk_idx_oblivious,
        globalize_recv_topk_idx_torch,
    )

    dev = ctx.device
    E_loc, H, I, K = EPLayout.of(p).local_experts, p.hidden, p.intermediate, p.top_k
    source, x, weights, num_recv, routing = _received(p, ctx)
    C = source.shape[0]
    w13, w2 = make_expert_weights(E_loc, H, I, seed=p.seed, device=dev)
    ws = make_workspace(C, K, E_loc, H, I, dtype=torch.bfloat16, device=dev)
    ids = source.clone()
    out = torch.empty(C, H, dtype=torch.bfloat16, device=dev)

    def neutralise(buf: torch.Tensor, use_fix: bool) -> None:
        if use_fix:
            globalize_recv_topk_idx(buf, num_recv, 0, E_loc)
        else:
            globalize_recv_topk_idx_oblivious(buf, num_recv, 0, E_loc)

    def run():
        ids.copy_(source)  # the buffer as dispatch left it (neutralising works in place)
        neutralise(ids, fixed)
        return fused_experts(x, w13, w2, weights, ids, workspace=ws, out=out)

    truth_ids = globalize_recv_topk_idx_torch(source.clone(), num_recv, 0, E_loc)
    own_ids = truth_ids if fixed else globalize_oblivious_reference(source, 0)
    n_recv = int(num_recv.item())
    info = {"num_recv": n_recv, "capacity": C, "stale_rows": C - n_recv,
            "polluted_routes": int((own_ids[n_recv:] >= 0).sum()), "computed_routes": int((own_ids >= 0).sum()),
            "configs": {"fused_experts": ws.choice.record()}}  # the launch fused_experts takes (tuned table or rule)

    def check() -> CheckResult:
        truth_out = fused_experts(x, w13, w2, weights, truth_ids.clone(), workspace=ws).clone()
        poison(out)
        poison(ws.act)
        poison(ws.y)
        run()
        ids_ok = CheckResult(bool(torch.equal(ids, own_ids)),
                             "" if torch.equal(ids, own_ids) else "neutralised ids differ from the reference")
        res = CheckResult.merge(ids_ok, check_experts_out(out, x, w13, w2, weights, own_ids, seed=p.seed))
        differs = (out.view(torch.int16) != truth_out.view(torch.int16)).any(dim=1)
        info["wrong_output_rows"] = int(differs.sum())
        res.metrics["wrong_output_rows"] = float(info["wrong_output_rows"])
        return res

    # declared work: the useful routes (received rows only), the same for both, so their rooflines compare
    useful = int((truth_ids >= 0).sum())
    experts_used = int(torch.unique(truth_ids[truth_ids >= 0]).numel())
    flops = 2 * useful * 3 * H * I
    bytes_moved = experts_used * 3 * H * I * 2 + n_recv * H * 2 + useful * (I + H) * 2 * 2 + C * H * 2 + C * K * 16
    return Case(run=run, check=check, flops=flops, bytes_moved=bytes_moved,
                bytes_note="useful work: weights of experts hit by received rows + those rows + act/y + out + ids",
                routing=routing, info=info, nvtx_stage="recv_experts")


@register_impl("recv_experts.triton", targets=("kernel",), available=_available,
               description="receive buffer (capacity rows, num_recv written) neutralised by "
                           "globalize_recv_topk_idx, then fused_experts over every row: stale rows do no work")
def build_fixed(p: Params, ctx: RunContext) -> Case:
    return _build(p, ctx, fixed=True)


@register_impl("recv_experts.oblivious", targets=("kernel",), available=_available, twin_of="recv_experts.triton",
               description="before the fix: stale rows past num_recv keep their ids and are computed by the "
                           "experts like received rows")
def build_oblivious(p: Params, ctx: RunContext) -> Case:
    return _build(p, ctx, fixed=False)


def _capacity(p: Params) -> int:
    """The receive buffer's rows (_received: at least num_max_tokens_per_rank; the received rows are <= num_tokens)."""
    return max(p.knobs(CapacityKnobs).num_max_tokens_per_rank, p.num_tokens)


# the interpreter runs fused_experts (its alignment and slot sum included) over every row of the buffer, stale or not
declare_work("recv_experts", PointWork(call=lambda p: expected_expert_work(p, p.num_tokens, p.local_experts), launches=12,
                                      programs=lambda p: fused_experts_programs(
                                          p, _capacity(p), p.local_experts,
                                          interpreted_reduce_block_h(p, _capacity(p), p.local_experts))))
