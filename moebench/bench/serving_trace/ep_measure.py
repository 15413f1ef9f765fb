"""The EP step over a serving trace, measured: every source call's routing (routes.StepRoutes), every EP rank's
expert time (each distinct workload timed, or a cost model with the decisive workloads timed: `rank_time_lookup`,
the one place the rank timer and rank_plan.plan_rank_times are called), the wire model (wire.py), the composition of
every distinct step at once (ep_arrays) and the replay check of its first steps (replay.ep_replay: every rank timed
directly, no model, no cache).

Rank times. Every micro-batch of the trace's distinct steps, per side, is a contest for the slowest rank
(rank_plan.Contest); when the distinct rank workloads number at most `ep_rank_timings` each is timed
(`rank_times: timed`), else that many are timed by rank_plan.plan_rank_times: a designed set for a cost model per
launch config, then the candidates for each contest's slowest rank, most decisive first, with the model's
held-out error (`rank_times: model`). The contests are read off the same source tables as the composition
(ep_arrays.SourceTables); steps are built one by one (ep_step.StepMicroBatches) only for the replay and the largest
step's record.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.ep_arrays import EPColumns, SourceTables, compose_arrays
from moebench.bench.serving_trace.ep_step import (StepMicroBatches, compose_priced, largest_step, layout_of,
                                                  placement)
from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.launch import launch_of
from moebench.bench.serving_trace.masked_steps import MaskedStepStore, share_steps, shares_masked_steps
from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX
from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.rank_plan import Contest, plan_rank_times
from moebench.bench.serving_trace.rank_timing import RankTimer
from moebench.bench.serving_trace.record import SIDES, EPStepRecord, PhaseClock, RankPlan
from moebench.bench.serving_trace.replay import REPLAY_TOLERANCE, ep_replay
from moebench.bench.serving_trace.routes import StepRoutes
from moebench.bench.serving_trace.step_calls import StepCalls
from moebench.bench.serving_trace.wire import cards, wire_model_of, wire_time
from moebench.inputs.engine_padding import StepPadding
from moebench.params import Params, Timing

# distinct steps whose rank workloads are read for the choice above and the fit's sample (a bound on time and
# memory: a million-step trace has ~1e5 distinct steps and 1e6 workloads, a fit needs their range, not all of them)
COLLECT_STEPS = 4_000


def workload_steps(total_rows: np.ndarray) -> np.ndarray:
    """Which steps' rank workloads are read (indices, given each step's rows over its calls): every step up to
    COLLECT_STEPS; beyond, the largest tenth of that many (the model must reach the biggest workloads) and an even
    spread of the rest (a cost model is then fitted whatever the count: the steps not read need it)."""
    n = len(total_rows)
    if n <= COLLECT_STEPS:
        return np.arange(n)
    by_rows = np.argsort(-np.asarray(total_rows), kind="stable")
    top = COLLECT_STEPS // 10
    rest = by_rows[top:]
    spread = rest[np.round(np.arange(COLLECT_STEPS - top) * (len(rest) - 1) / (COLLECT_STEPS - top - 1)).astype(int)]
    return np.unique(np.concatenate([by_rows[:top], spread]))


def contests_of(calls: StepCalls, counts: np.ndarray, tables: SourceTables, layout) -> list[Contest]:
    """Every micro-batch of the steps, both sides, as a contest for the slowest rank (the same ranks' workloads
    merged, the steps they stand for added)."""
    R, epr = layout.ep_size, layout.local_experts
    merged: dict[bytes, list] = {}
    present = calls.present
    ranks = {}  # per (side, micro-batch): [S, R, 1 + E/R] rows received and routes to each local expert
    for side in SIDES:
        for m in range(present.shape[1]):
            got = tables.gather(calls, m, side)
            ranks[(side, m)] = np.concatenate([got["received"][:, :, None], got["experts"].reshape(-1, R, epr)],
                                              axis=2)
    for i in range(calls.num_steps):  # in step order, as the contests were met one step at a time
        for side in SIDES:
            for m in np.flatnonzero(present[i]).tolist():
                key = ranks[(side, m)][i].tobytes()
                if key in merged:
                    merged[key][0] += int(counts[i])
                else:
                    merged[key] = [int(counts[i]), ranks[(side, m)][i]]
    return [Contest(n, tuple(Workload(int(w[0]), tuple(w[1:].tolist())) for w in ranks))
            for n, ranks in merged.values()]


class _Counted:
    """A rank timer that reports each timing to the run's progress line."""

    def __init__(self, timer, progress):
        self.timer, self.progress, self.done, self.total, self.what = timer, progress, 0, 0, ""

    def expect(self, total: int, what: str) -> None:
        self.done, self.total, self.what = 0, total, what

    def __call__(self, w: Workload) -> float:
        self.progress(self.done, max(self.total, self.done + 1), self.what, f"{w.rows} rows, {w.routes} routes")
        self.done += 1
        return self.timer(w)


def rank_time_lookup(p: Params, device: torch.device, timing: Timing, contests: Sequence[Contest], complete: bool,
                     progress: Callable[..., None], known: dict[Workload, float] | None = None
                     ) -> tuple[Callable[[Workload], float], RankPlan, _Counted]:
    """(rank time lookup, its record, the timer the replay reuses): the one place the EP step times rank
    workloads (RankTimer) and turns the timings into rank times (rank_plan.plan_rank_times). `known`: the run's
    timings at this layer point (rank_timing.RankStore), read here and given this point's new ones."""
    timer = _Counted(RankTimer(p, device, timing), progress)
    kind = "cuda" if device.type == "cuda" else "cpu"
    serving = p.knobs(ServingKnobs)
    budget = serving.rank_timings(kind)
    known = {} if known is None else known
    timer.expect(min(budget, len({w for c in contests for w in c.workloads if w.rows and w not in known})),
                 "EP step: rank workloads timed")
    lookup, plan = plan_rank_times(contests, timer, budget, launch_of(p, device), REPLAY_TOLERANCE,
                                   complete=complete, rows_max=TIMED_ROWS_MAX[kind], known=dict(known),
                                   seconds=serving.rank_seconds(kind))
    known.update(lookup.timed)
    plan.timer = {"spent_s": round(timer.timer.spent_s, 3), "timings": timer.timer.timed}
    return lookup, plan, timer


def measure_ep_step(p: Params, device: torch.device, timing: Timing, calls: StepCalls, counts: Sequence[int],
                    replay_steps: Sequence[StepPadding], clock: PhaseClock,
                    progress: Callable[..., None] | None = None, known: dict[Workload, float] | None = None,
                    masked_steps: MaskedStepStore | None = None) -> tuple[EPStepRecord, EPColumns]:
    """(info.ep_step, every distinct step's EP-step figures per side). `progress(done, total, what)`:
    RunContext.progress; `clock` gets the EP step's phases (routing, rank_workloads, host_composition, replay);
    `known`: the run's rank timings at this layer point (rank_time_lookup); `masked_steps`: the run's masked-step
    figures at this EP configuration, read and extended where a masked step is its real tokens' alone
    (masked_steps.py)."""
    t0 = time.perf_counter()
    progress = progress or (lambda done, total, what, detail="": None)
    layout = layout_of(p)
    routes = StepRoutes(p, device, layout)
    wire_model = wire_model_of(p)
    counts = np.asarray(counts, dtype=np.int64)
    with clock.phase("routing"):
        routed = routes.prepare_calls(calls, list(replay_steps),
                                      lambda i, n: progress(i, n, "EP step: source slots routed"))
    with clock.phase("host_composition"):
        tables = SourceTables(routes.slots, layout, calls.real_tokens.shape[1], wire_model.ranks_per_node)
        read = workload_steps(calls.total_rows())
        contests = contests_of(calls.take(read), counts[read], tables, layout)
    with clock.phase("rank_workloads"):
        rank_time, rank_plan, timer = rank_time_lookup(p, device, timing, contests, len(read) == calls.num_steps,
                                                        progress, known)
    with clock.phase("host_composition"):
        columns = compose_arrays(calls, tables, rank_time, wire_model, layout)
        shared = (share_steps(masked_steps, calls, columns.sides)
                  if masked_steps is not None and shares_masked_steps(p) else None)
        tot = columns.totals(counts, layout.dbo)
        built = StepMicroBatches(layout, routes, wire_time(wire_model))
        largest = _largest_step(calls, built, rank_time, layout.dbo)
    replay = None
    if replay_steps:
        with clock.phase("replay"):
            built.keep(replay_steps)  # a step the replay reads twice is built once
            step_mbs = [built(s) for s in replay_steps]
            timer.expect(sum(len(mbs[side]) * layout.ep_size for mbs in step_mbs for side in SIDES),
                         "EP step: replay ranks timed")
            replay = ep_replay(step_mbs, rank_time, timer, layout.dbo)
    record = EPStepRecord(
        view="ep_step: the slowest EP rank's expert kernel plus dispatch and combine, per step",
        placement=placement(p), ranks_per_node=wire_model.ranks_per_node,
        payload={"dtype": "fp8" if p.expert_dtype == "fp8" else "bf16",
                 "dispatch_row_bytes": layout.dispatch_row_bytes, "combine_row_bytes": layout.combine_row_bytes},
        wire=wire_model.record(), rank_times=rank_plan.rank_times,
        distinct_workloads=rank_plan.distinct_workloads, rank_timings=rank_plan.rank_timings,
        cost_model=rank_plan.cost_model, workloads_read_from_steps=len(read), routed_slots=routed,
        rank_plan=rank_plan.rest(), masked_steps_shared=shared,
        totals={side: {k: round(v, 3) for k, v in tot["sums"][side].items()} for side in SIDES},
        tax={k: ({s: round(x, 3) for s, x in v.items()} if isinstance(v, dict) else round(v, 3))
             for k, v in tot["tax"].items()},
        largest_step=largest, slowest_rank_padded_route_share=columns.padded_route_share(counts), replay=replay,
        wall_s=round(time.perf_counter() - t0, 3),
        **cards(device, wire_model))
    return record, columns


def _largest_step(calls: StepCalls, built: StepMicroBatches, rank_time, dbo: bool) -> dict:
    """ep_step.largest_step of the step with the most rows (the first such), composed on its own: every rank's time
    of it is in the record."""
    if not calls.num_steps:
        return {}
    step = calls.step(int(np.argmax(calls.total_rows())))
    built.keep([step])
    return largest_step([step], compose_priced([built(step)], rank_time, dbo))
