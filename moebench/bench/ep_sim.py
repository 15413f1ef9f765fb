"""The ep_sim bench family, `ep_mode: simulated`: expert parallelism with more EP ranks than GPUs, computed and
replayed on one GPU.

A point of `ep_sim.experts` stands for p.ep_size EP ranks, each holding p.num_tokens rows: rank s's batch is
inputs.make_batch(p, seed_offset=s) (so every rank has its own padding, filled per p.padding_fill), routed over all
p.num_experts experts by inputs.route (masked when p.mask: padded rows get -1 and go nowhere). Rank r owns the
experts [r*E/R, (r+1)*E/R).
  - Loads are exact: the routes each rank's experts receive, split into real and padding routes, are a function
    of the routing only (measure.imbalance); they do not depend on how many GPUs ran the point.
  - Time is replayed: every rank's workload (the rows that have at least one route to its experts, from every
    source rank: what a token dispatch delivers, and its routes per local expert) is timed on this one GPU by the
    serving trace's rank timer (moebench.bench.serving_trace.rank_timing.RankTimer, the one way a rank is timed:
    fused_experts with E/R local experts on exactly those rows and counts, settled samples). The straggler time is
    the max over ranks: an EP layer waits for its slowest rank. Every simulated rank uses the same seeded weights:
    they have the shapes of any rank's weights, which is all the time depends on.
`run()` (what the runner times) replays the slowest rank's expert work; every rank's time is in Case.info
(`per_rank_us`), as are `per_rank_routes` {real, padding}, `slowest_rank` and the headline imbalance figures.
Records are labelled simulated (info["simulated"], and ep_mode in the parameters): computed, not measured on
ep_size GPUs. Communication is not part of the simulation (a dispatch sweep measures it on real ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from moebench import inputs
from moebench.bench.experts import check_experts_out
from moebench.check import CheckResult, poison
from moebench.inputs import make_expert_weights
from moebench.kernels.runtime import interpreting
from moebench.kernels.fused_experts import expert_work, fused_experts, fused_experts_torch, make_workspace
from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.rank_timing import RankTimer
from moebench.measure.imbalance import expert_figures, imbalance, per_rank_loads, rank_figures
from moebench.params import EPLayout, Params, Timing
from moebench.measure.cost import INTERP_PROGRAM_S, PointWork, expected_expert_work, expert_programs
from moebench.registry import Case, Routing, RunContext, register_impl, declare_work

REPS_CUDA = 5  # timed replays per rank on a GPU (median)
REPS_CPU = 1  # on a CPU (the interpreter) one replay: the figures are only a smoke signal there


@dataclass
class SimulatedEP:
    """All ranks' batches, routed, concatenated rank-major: rows [s*T, (s+1)*T) are source rank s's."""

    hidden: torch.Tensor  # [R*T, H] bf16
    topk_weights: torch.Tensor  # [R*T, K] fp32
    topk_ids: torch.Tensor  # [R*T, K] global ids, -1 on masked padded rows
    is_padding: torch.Tensor  # [R*T] bool, padding whether or not it was masked
    layout: EPLayout  # which simulated rank owns which experts


def simulated_batches(p: Params, device: torch.device, *, need_hidden: bool = True) -> SimulatedEP:
    """p.ep_size ranks' batches (make_batch with seed_offset = rank), routed per p.mask, concatenated."""
    hidden, weights, ids, pads = [], [], [], []
    for rank in range(p.ep_size):
        batch = inputs.make_batch(p, device, need_hidden=need_hidden, seed_offset=rank)
        w, i = inputs.route(p, batch)
        weights.append(w.float())
        ids.append(i.to(torch.int32))
        pads.append(batch.is_padding)
        if need_hidden:
            hidden.append(batch.hidden)
    return SimulatedEP(hidden=torch.cat(hidden) if need_hidden else None, topk_weights=torch.cat(weights),
                       topk_ids=torch.cat(ids), is_padding=torch.cat(pads), layout=EPLayout.of(p))


@dataclass
class RankWork:
    """What destination rank r computes: its received rows and their routing made local."""

    rank: int
    rows: torch.Tensor  # int64 [M]: global row indices (rank-major) with >= 1 route to this rank's experts
    local_ids: torch.Tensor  # int32 [M, K]: local expert id, -1 for slots on other ranks / none
    topk_weights: torch.Tensor  # fp32 [M, K]
    real_routes: int
    padding_routes: int
    real_rows: int
    padding_rows: int


def rank_work(sim: SimulatedEP, rank: int) -> RankWork:
    """Rank `rank`'s share of the routing: every (row, rank) pair once, with the row's slots for this rank."""
    epr = sim.layout.local_experts
    lo = sim.layout.first_expert(rank)
    ids = sim.topk_ids.to(torch.int64)
    mine = (ids >= lo) & (ids < lo + epr)
    local = torch.where(mine, ids - lo, torch.full_like(ids, -1)).to(torch.int32)
    rows = mine.any(dim=1).nonzero(as_tuple=True)[0]
    pad_rows = sim.is_padding[rows]
    routes_per_row = mine[rows].sum(dim=1)
    padding_routes = int(routes_per_row[pad_rows].sum().item())
    total_routes = int(routes_per_row.sum().item())
    return RankWork(rank=rank, rows=rows, local_ids=local[rows].contiguous(),
                    topk_weights=sim.topk_weights[rows].contiguous(), real_routes=total_routes - padding_routes,
                    padding_routes=padding_routes, real_rows=int((~pad_rows).sum().item()),
                    padding_rows=int(pad_rows.sum().item()))


def workload_of(work: RankWork, local_experts: int) -> Workload:
    """A simulated rank's workload as the rank timer reads it: its rows and its routes per local expert."""
    ids = work.local_ids[work.local_ids >= 0].to(torch.int64)
    return Workload(int(work.rows.numel()), tuple(torch.bincount(ids, minlength=local_experts).tolist()))


class _RankRunner:
    """One rank's inputs gathered, its output and fused_experts workspace allocated; `run` is the expert work."""

    def __init__(self, sim: SimulatedEP, work: RankWork, w13: torch.Tensor, w2: torch.Tensor, use_triton: bool):
        self.work = work
        self.x = sim.hidden.index_select(0, work.rows)
        M, K = work.local_ids.shape
        E_loc, H, I = w13.shape[0], w13.shape[2], w2.shape[2]
        self.w13, self.w2 = w13, w2
        self.out = torch.empty(M, H, dtype=torch.bfloat16, device=self.x.device)
        self.workspace = make_workspace(M, K, E_loc, H, I, dtype=torch.bfloat16, device=self.x.device) \
            if use_triton and M else None
        if use_triton:
            def run():
                return fused_experts(self.x, w13, w2, work.topk_weights, work.local_ids, workspace=self.workspace,
                                     out=self.out)
        else:
            def run():
                self.out.copy_(fused_experts_torch(self.x, w13, w2, work.topk_weights, work.local_ids,
                                                   compute_dtype=torch.bfloat16))
        self.run = run

    def flops_and_bytes(self) -> tuple[int, int]:
        """Useful work of this rank (valid routes only), counted as fused_experts.* counts it (expert_work)."""
        ids = self.work.local_ids
        H, I = self.w13.shape[2], self.w2.shape[2]
        valid = ids >= 0
        n_valid = int(valid.sum().item())
        experts_used = int(torch.unique(ids[valid]).numel()) if n_valid else 0
        M, K = ids.shape
        # every received row has a route to this rank: all M rows are read
        return expert_work(n_valid, experts_used, M, H, I, out_rows=M, top_k=K)


def _use_triton(ctx: RunContext) -> bool:
    return ctx.is_cuda or interpreting()


def _build(p: Params, ctx: RunContext) -> Case:
    dev = ctx.device
    R, E = p.ep_size, p.num_experts
    use_triton = _use_triton(ctx)
    sim = simulated_batches(p, dev)
    w13, w2 = make_expert_weights(sim.layout.local_experts, p.hidden, p.intermediate, seed=p.seed, device=dev)
    reps = REPS_CUDA if dev.type == "cuda" else REPS_CPU

    works = [rank_work(sim, r) for r in range(R)]
    timer = RankTimer(replace(p, expert_dtype="bf16"), dev,
                      Timing(mode="events", warmup=1, iters=reps, unroll=1, max_seconds=float("inf")),
                      triton=use_triton)
    per_rank_us = []
    for r, work in enumerate(works):
        ctx.progress(r, R, "simulated ranks timed", f"rank {r}")
        per_rank_us.append(timer(workload_of(work, sim.layout.local_experts)))
    ctx.progress(R, R, "simulated ranks timed")
    del timer
    slowest = max(range(R), key=lambda r: per_rank_us[r])
    replay = _RankRunner(sim, works[slowest], w13, w2, use_triton)
    flops, bytes_moved = replay.flops_and_bytes()

    real_routes = [w.real_routes for w in works]
    pad_routes = [w.padding_routes for w in works]
    loads = [a + b for a, b in zip(real_routes, pad_routes)]
    ranks_all = rank_figures(loads)
    per_expert = torch.bincount(sim.topk_ids[sim.topk_ids >= 0].to(torch.int64), minlength=E).tolist()
    experts_all = expert_figures(per_expert)
    mean_us = sum(per_rank_us) / R
    info: dict[str, Any] = {
        "simulated": True,
        "ep_size": R,
        "num_local_experts": sim.layout.local_experts,
        "per_rank_us": [round(t, 3) for t in per_rank_us],
        "slowest_rank": slowest,
        "slowest_us": round(per_rank_us[slowest], 3),
        "mean_rank_us": round(mean_us, 3),
        "straggler_ratio": per_rank_us[slowest] / mean_us if mean_us > 0 else 0.0,
        "per_rank_routes": {"real": real_routes, "padding": pad_routes},
        "per_rank_rows": {"real": [w.real_rows for w in works], "padding": [w.padding_rows for w in works]},
        "slowest_rank_by_load": ranks_all["slowest_rank"],
        "slowest_excess_routes": ranks_all["slowest_excess"],
        "slowest_excess_ratio": ranks_all["slowest_excess_ratio"],
        # the launch the timed (slowest) rank's fused_experts takes: its rows make its own bucket
        **({"configs": {"fused_experts": replay.workspace.choice.record()}} if replay.workspace is not None else {}),
        "hottest_expert": experts_all["hottest"],
        "hottest_expert_share": experts_all["hottest_share"],
        "timing_note": (f"per-rank: its workload (rows, routes per local expert) timed by the rank timer "
                        f"({'settled samples' if dev.type == 'cuda' else f'median of {reps} wall-clock timings'} of "
                        f"its fused_experts ({'Triton' if use_triton else 'torch'}) on one device); run() replays the "
                        f"slowest rank on its own rows; communication not included"),
    }

    def run():
        return replay.run()

    def check() -> CheckResult:
        results = []
        # the per-rank split must reproduce the loads computed from the routing, exactly
        expect = imbalance(sim.topk_ids, sim.is_padding, E, R)
        for name, got, want in (("per_rank_real", real_routes, expect["per_rank_real"]),
                                ("per_rank_padding", pad_routes, expect["per_rank_padding"]),
                                ("per_rank_loads", loads, per_rank_loads(sim.topk_ids, E, R).tolist())):
            ok = got == want
            results.append(CheckResult(ok, "" if ok else f"{name}: split {got} != routing {want}",
                                       {f"{name}.mismatches": float(sum(a != b for a, b in zip(got, want)))}))
        # the replayed (slowest) rank's expert output against the fp32 reference
        if replay.x.shape[0]:
            poison(replay.out)
            if replay.workspace is not None:
                poison(replay.workspace.act)
                poison(replay.workspace.y)
            replay.run()
            results.append(check_experts_out(replay.out, replay.x, w13, w2, replay.work.topk_weights,
                                      replay.work.local_ids, seed=p.seed))
        return CheckResult.merge(*results)

    def cleanup():
        nonlocal replay
        replay = None

    return Case(run=run, check=check, flops=flops, bytes_moved=bytes_moved,
                bytes_note="slowest simulated rank: weights of its experts with >=1 route + its rows + act/y "
                           "written+read + out (useful routes only)",
                routing=Routing(sim.topk_ids, sim.is_padding, E, R), graph_capturable=use_triton,
                info=info, nvtx_stage="experts", cleanup=cleanup)


def _validate(p: Params) -> str | None:
    if p.ep_mode != "simulated":
        return "ep_mode: ep_sim.experts needs ep_mode: simulated (real EP sizes are measured by dispatch paths)"
    per_rank = EPLayout.of(p).local_experts
    if p.num_local_experts is not None and p.num_local_experts != per_rank:
        return (f"num_local_experts: simulated ranks own num_experts / ep_size = {per_rank} "
                f"experts, got {p.num_local_experts}")
    return None


register_impl("ep_sim.experts", targets=("dispatch", "layer"), validate=_validate,
              description="simulated EP: exact per-rank loads from every rank's routing; each rank's expert work "
                          "(fused_experts on its received rows) replayed on one GPU; straggler = slowest rank")(_build)
def _one_rank_s(p: Params, rates) -> float:
    """One simulated rank's expert work (its share of the routes, its local experts)."""
    local = p.num_experts // p.ep_size
    if rates.kind == "interpreter":
        return expert_programs(p, p.num_tokens, local) / p.ep_size * INTERP_PROGRAM_S
    return rates.seconds(*expected_expert_work(p, p.num_tokens, local), 12)


# the timed call replays every rank's expert work one rank after the other; building the point times each rank
# alone first (a warm-up and REPS calls)
declare_work("ep_sim", PointWork(
    call=lambda p: expected_expert_work(p, p.num_tokens * p.ep_size, p.num_experts // p.ep_size),
    launches=lambda p: 12 * p.ep_size,
    programs=lambda p: p.ep_size * expert_programs(p, p.num_tokens, p.num_experts // p.ep_size),
    build=lambda p, rates: p.ep_size * (1 + (REPS_CUDA if rates.is_cuda else REPS_CPU)) * _one_rank_s(p, rates)))
