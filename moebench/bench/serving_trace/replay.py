"""Both replay checks of a serving_trace point, each against REPLAY_TOLERANCE (recorded with its verdict):

  single_rank_replay  the trace's first steps replayed call by call (fresh batches and pipelines, the exact call
                      shapes) against their composition (in interpolated mode: what validates the interpolation);
                      the padding time and tax both ways too
  ep_replay           the first steps of the EP step as the run composes them (its rank times) against a replay
                      with every rank of every micro-batch timed afresh (no model, no cache), the slowest taken:
                      written out here, apart from ep_step's composition, so that the check holds that too; the
                      expert time (the part a cost model reads) and the step time per side
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from moebench.bench.serving_trace import ep_step
from moebench.bench.serving_trace.compose import ShapeTimer, compose, layer_totals, step_times
from moebench.bench.serving_trace.headline import share
from moebench.bench.serving_trace.ep_step import StepMBs, dbo_step_us
from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.record import SIDES, EPReplayRecord, ReplayRecord, within_tolerance
from moebench.inputs.engine_padding import StepPadding

REPLAY_TOLERANCE = 0.03  # the most a composition may differ from its replay, per side and figure


def replay_calls(paddings: Sequence[StepPadding], time_call: ShapeTimer) -> list[dict[str, dict[str, float]]]:
    """The same figures with `time_call` asked for every call of every step, in order (no cache)."""
    return [step_times(step, time_call) for step in paddings]


def single_rank_replay(bench, steps: Sequence[StepPadding], time_of) -> ReplayRecord:
    """The composition of `steps` through `time_of` against every call of them timed afresh by `bench`."""

    def fresh(side: str, rows: int, real: int) -> float:
        sp, batch = bench.batch(rows, real)
        return bench.time_side(sp, batch, side)

    t0 = time.perf_counter()
    replayed_tot, composed_tot = layer_totals(replay_calls(steps, fresh)), layer_totals(compose(steps, time_of))
    replayed, composed = replayed_tot["layer_us"], composed_tot["layer_us"]
    rel = {s: abs(composed[s] - replayed[s]) / replayed[s] if replayed[s] else None for s in SIDES}
    # the split too: the replay times every call's real tokens alone afresh, so its padding time is the
    # call-by-call one the composition's tax must agree with
    tax = {name: {s: share(tot["padding_us"][s], tot["layer_us"][s]) for s in SIDES}
           for name, tot in (("composed", composed_tot), ("replayed", replayed_tot))}
    return ReplayRecord(
        steps=len(steps), calls=sum(len(s.calls) for s in steps), composed_us=composed, replayed_us=replayed,
        rel_diff=rel, wall_s=round(time.perf_counter() - t0, 3),
        within_tolerance={s: within_tolerance(rel[s], REPLAY_TOLERANCE) for s in SIDES}, tolerance=REPLAY_TOLERANCE,
        composed_padding_us=composed_tot["padding_us"], replayed_padding_us=replayed_tot["padding_us"],
        composed_tax=tax["composed"], replayed_tax=tax["replayed"])


def _replayed_sums(step_mbs: Sequence[StepMBs], timer: Callable[[Workload], float], dbo: bool) -> dict:
    """Per side, the steps' expert and step time with every rank of every micro-batch timed by `timer`."""
    sums = {side: {"experts_us": 0.0, "step_us": 0.0} for side in SIDES}
    for mbs in step_mbs:
        for side in SIDES:
            parts = []
            for mb in mbs[side]:
                slowest = max(timer(w) for w in mb.workloads)
                parts.append((mb.dispatch_us, slowest, mb.combine_us))
                sums[side]["experts_us"] += slowest
            sums[side]["step_us"] += dbo_step_us(parts) if dbo else sum(map(sum, parts))
    return sums


def ep_replay(step_mbs: Sequence[StepMBs], composed_time, timer: Callable[[Workload], float],
              dbo: bool) -> EPReplayRecord:
    """The steps (their priced micro-batches) composed with the run's rank times against every rank timed by
    `timer`."""
    t0 = time.perf_counter()
    composed = ep_step.step_totals(ep_step.compose_priced(step_mbs, composed_time, dbo))["sums"]
    replayed = _replayed_sums(step_mbs, timer, dbo)
    figures = ("experts_us", "step_us")
    rel = {side: {k: abs(composed[side][k] - replayed[side][k]) / replayed[side][k] if replayed[side][k] else None
                  for k in figures} for side in SIDES}
    return EPReplayRecord(
        steps=len(step_mbs),
        composed={side: {k: round(composed[side][k], 3) for k in figures} for side in SIDES},
        replayed={side: {k: round(replayed[side][k], 3) for k in figures} for side in SIDES},
        rel_diff=rel,
        within_tolerance={side: all(within_tolerance(v, REPLAY_TOLERANCE) for v in rel[side].values())
                          for side in SIDES},
        tolerance=REPLAY_TOLERANCE, wall_s=round(time.perf_counter() - t0, 3))
