"""The EP step over a serving trace, measured: every source call's routing, every EP rank's expert time (each
distinct workload timed, or a cost model fitted to timed ones), the wire model, the composition per distinct step
(moebench.bench.serving_trace.ep_step) and the replay check of its first steps (every rank timed directly, no model, no cache).

Rank times. The distinct rank workloads of the trace (rows received, routes per local expert) are collected; when
there are at most `ep_rank_timings` of them each is timed (`rank_times: timed`), else that many, spread over their
range (rank_cost.fit_sample), are timed and a non-negative linear cost model is fitted to them
(`rank_times: model`). The replay check composes the first `trace_replay` steps again with every rank's workload
timed afresh and compares the expert time (the part the model reads) and the step time per side: within 5%.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch

from moebench.bench.serving_trace.ep_step import (SIDES, CallRoutes, Layout, SideStep, compose_steps, dbo_step_us, micro_batches,
                                     totals)
from moebench.bench.serving_trace.rank_cost import Contest, Workload, launch_of, plan_rank_times
from moebench.bench.serving_trace.rank_timing import RankTimer
from moebench.dispatch.wire_model import combine_row_bytes, dispatch_row_bytes, wire_model_of
from moebench.inputs.engine_padding import StepPadding
from moebench.params import Params, Timing
from moebench.traces.knobs import ServingKnobs

# distinct rank workloads timed one by one (beyond: a model fitted to this many) when the sweep leaves
# ep_rank_timings unset; the interpreter's budget is a smoke test's
DEFAULT_RANK_TIMINGS = {"cuda": 384, "cpu": 6}
# distinct steps whose rank workloads are read for the choice above and the fit's sample (a bound on time and
# memory: a million-step trace has ~1e5 distinct steps and 1e6 workloads, a fit needs their range, not all of them)
COLLECT_STEPS = 4_000
REPLAY_TOLERANCE = 0.03
SLOT_SEED = 104_729 * 7_919  # the source slots' batches: seed offsets past every single-rank shape's


def layout_of(p: Params) -> Layout:
    payload = "fp8" if p.expert_dtype == "fp8" else "bf16"
    serving = p.knobs(ServingKnobs)
    return Layout(p.ep_size, p.num_experts, serving.sp_size, dispatch_row_bytes(p.hidden, p.top_k, payload),
                  combine_row_bytes(p.hidden), serving.dbo, max(1, p.ep_size // (serving.dp_size * serving.sp_size)))


def placement(p: Params) -> str:
    serving = p.knobs(ServingKnobs)
    sources = serving.dp_size * serving.sp_size
    if sources == p.ep_size:
        return f"one source (DP rank x SP rank) on each of the {p.ep_size} EP ranks"
    if sources < p.ep_size:
        return (f"{p.ep_size // sources} DP groups of DP x SP = {sources} sources, one on each of the {p.ep_size} EP "
                f"ranks: each group the trace's token counts, its own routing")
    return f"{sources} sources (DP x SP) on {p.ep_size} EP ranks, source s on rank s mod {p.ep_size}"


class StepRoutes:
    """The routing of every source call of the steps, per side, from one routed batch per source slot.

    A call (rows, real) of slot s is the first `real` rows of slot s's real-token batch followed by rows - real
    padded rows (the producers' layout: real tokens at the head). Routing is per row, so the call's routes are the
    prefix's plus its padding's: routed once per slot, then counted per call (the padding, oblivious only: masked
    padded rows route nowhere). The padded rows are what padding_fill makes them: zeros (the same router input on
    every source), repeat (copies of the call's first real row: row 0 of the slot's batch), random / stale (rows of
    a second batch per slot). One selection bias for every source (slot 0's): it is the model's, not a source's."""

    def __init__(self, p: Params, device, layout: Layout):
        self.p, self.device, self.layout = p, device, layout
        self.slots: dict[int, tuple] = {}  # slot -> (real ids, real rank hits, pad ids, pad rank hits)
        self.cache: dict[tuple[int, int, int], dict] = {}
        self.bias = None

    def _routed(self, sp: Params, batch) -> tuple:
        from moebench.inputs import route
        from moebench.params import EPLayout

        batch = dataclasses.replace(batch, bias=self.bias)
        _, ids = route(sp, batch, use_mask=False)
        ids = ids.to(torch.int64).cpu()
        lay = EPLayout(0, self.p.ep_size, self.p.num_experts)
        hits = torch.zeros(ids.shape[0], lay.ep_size + 1, dtype=torch.bool)
        hits.scatter_(1, torch.where(ids >= 0, ids // lay.local_experts, lay.ep_size), True)
        return ids, hits[:, :lay.ep_size]

    def _route_slot(self, slot: int, rows: int) -> None:
        from moebench.bench.serving_trace.shapes import shape_params
        from moebench.inputs import make_batch

        sp = shape_params(self.p, rows, rows)
        real = make_batch(sp, self.device, need_hidden=False, seed_offset=SLOT_SEED * (slot + 1))
        if self.bias is None:
            self.bias = real.bias
        real_ids, real_hits = self._routed(sp, real)
        if self.p.padding_fill == "repeat":
            pad_ids, pad_hits = real_ids[:1].expand(rows, -1), real_hits[:1].expand(rows, -1)
        else:
            pad = make_batch(shape_params(self.p, rows, 0), self.device, need_hidden=False,
                             seed_offset=SLOT_SEED * (slot + 1) + 1)
            pad_ids, pad_hits = self._routed(shape_params(self.p, rows, 0), pad)
        self.slots[slot] = (real_ids, real_hits, pad_ids, pad_hits)

    def prepare(self, steps: Sequence[StepPadding], progress: Callable[[int, int], None] | None = None) -> int:
        """Route every slot the steps' calls need, at the most rows any of its calls has; returns the slots routed."""
        lay = self.layout
        rows: dict[int, int] = {}
        for s in steps:
            for c in s.calls:
                for q in range(lay.replicas):
                    slot = lay.slot(q, len(s.real), c.dp_rank, c.sp_rank)
                    rows[slot] = max(rows.get(slot, 0), c.rows)
        todo = sorted(k for k in rows if k not in self.slots or self.slots[k][0].shape[0] < rows[k])
        for i, slot in enumerate(todo):
            self._route_slot(slot, rows[slot])
            if progress:
                progress(i + 1, len(todo))
        if todo:
            self.cache.clear()
        return len(todo)

    def __call__(self, rows: int, real: int, slot: int, side: str) -> CallRoutes:
        key = (rows, real, slot)
        if key not in self.cache:
            real_ids, real_hits, pad_ids, pad_hits = self.slots[slot]
            E = self.p.num_experts
            ids, hits = real_ids[:real], real_hits[:real]
            masked = CallRoutes(tuple(torch.bincount(ids[ids >= 0], minlength=E).tolist()),
                                tuple(hits.sum(dim=0).tolist()))
            ids = torch.cat([ids, pad_ids[:rows - real]])
            hits = torch.cat([hits, pad_hits[:rows - real]])
            oblivious = CallRoutes(tuple(torch.bincount(ids[ids >= 0], minlength=E).tolist()),
                                   tuple(hits.sum(dim=0).tolist()))
            self.cache[key] = {"masked": masked, "oblivious": oblivious}
        return self.cache[key][side]


def _contests(steps: Sequence[StepPadding], counts: Sequence[int], layout: Layout, routes: StepRoutes
              ) -> tuple[list[Contest], int]:
    """Every micro-batch of every side of the steps as a contest for the slowest rank (the same ranks' workloads
    merged, their steps added), and how many steps they were read from: every step up to COLLECT_STEPS; beyond,
    the largest tenth of that many (the model must reach the biggest workloads) and an even spread of the rest (a
    cost model is then fitted whatever the count: the steps not read need it)."""
    if len(steps) > COLLECT_STEPS:
        by_rows = sorted(range(len(steps)), key=lambda i: -sum(c.rows for c in steps[i].calls))
        top = COLLECT_STEPS // 10
        rest = by_rows[top:]
        picked = by_rows[:top] + [rest[round(j * (len(rest) - 1) / (COLLECT_STEPS - top - 1))]
                                  for j in range(COLLECT_STEPS - top)]
        chosen = sorted(set(picked))
        steps, counts = [steps[i] for i in chosen], [counts[i] for i in chosen]
    merged: dict[tuple, int] = {}
    for s, n in zip(steps, counts):
        for side in SIDES:
            for mb in micro_batches(s, layout, routes, side):
                key = tuple(mb.workloads)
                merged[key] = merged.get(key, 0) + n
    return [Contest(n, key) for key, n in merged.items()], len(steps)


def _wire_time(model) -> Callable[[str, list[list[int]]], float]:
    def wire(phase: str, matrix: list[list[int]]) -> float:
        return float((model.dispatch_us if phase == "dispatch" else model.combine_us)(matrix).us)
    return wire


def _replayed_sums(steps: Sequence[StepPadding], layout: Layout, routes: StepRoutes, timer, wire) -> dict:
    """Per side, the steps' expert and step time with every rank of every micro-batch timed by `timer` and the
    slowest taken: written out here, apart from ep_step.py's composition, so that the check holds that too."""
    sums = {side: {"experts_us": 0.0, "step_us": 0.0} for side in SIDES}
    for s in steps:
        for side in SIDES:
            parts = []
            for mb in micro_batches(s, layout, routes, side):
                slowest = max(timer(w) for w in mb.workloads)
                parts.append((wire("dispatch", mb.dispatch_bytes), slowest, wire("combine", mb.combine_bytes)))
                sums[side]["experts_us"] += slowest
            sums[side]["step_us"] += dbo_step_us(parts) if layout.dbo else sum(map(sum, parts))
    return sums


def replay_check(steps: Sequence[StepPadding], layout: Layout, routes: StepRoutes, composed_time, timer,
                 wire) -> dict[str, Any]:
    """The first steps as the run composes them (its rank times) against a replay with every rank timed afresh."""
    t0 = time.perf_counter()
    composed = totals(compose_steps(steps, layout, routes, composed_time, wire))["sums"]
    replayed = _replayed_sums(steps, layout, routes, timer, wire)
    out: dict[str, Any] = {"steps": len(steps), "composed": {}, "replayed": {}, "rel_diff": {}, "within_5pct": {}}
    for side in SIDES:
        out["composed"][side] = {k: round(composed[side][k], 3) for k in ("experts_us", "step_us")}
        out["replayed"][side] = {k: round(replayed[side][k], 3) for k in ("experts_us", "step_us")}
        rel = {k: abs(composed[side][k] - replayed[side][k]) / replayed[side][k] if replayed[side][k] else None
               for k in ("experts_us", "step_us")}
        out["rel_diff"][side] = rel
        out["within_5pct"][side] = all(v is not None and v <= REPLAY_TOLERANCE for v in rel.values())
    out["wall_s"] = round(time.perf_counter() - t0, 3)
    return out


def _largest(steps: Sequence[StepPadding], per_step: Sequence[dict[str, SideStep]]) -> dict[str, Any]:
    """The step with the most rows: per side its slowest rank, that rank's time, the mean's, every rank's."""
    if not steps:
        return {}
    i = max(range(len(steps)), key=lambda j: (sum(c.rows for c in steps[j].calls), -j))
    out: dict[str, Any] = {"real": list(steps[i].real), "rows": sum(c.rows for c in steps[i].calls)}
    for side in SIDES:
        s = per_step[i][side]
        out[side] = {"slowest_rank": s.slowest_rank, "slowest_us": round(s.slowest_us, 3),
                     "mean_rank_us": round(sum(s.rank_us) / len(s.rank_us), 3) if s.rank_us else 0.0,
                     "rank_us": [round(t, 3) for t in s.rank_us], "rank_routes": s.rank_routes}
    return out


def padded_route_share(per_step: Sequence[dict[str, SideStep]], counts: Sequence[int]) -> float | None:
    """Of the padded routes over the trace (oblivious routes minus masked, per rank), the share that went to each
    step's slowest oblivious rank."""
    to_slowest = total = 0
    for st, n in zip(per_step, counts):
        o, m = st["oblivious"], st["masked"]
        if not o.rank_routes:
            continue
        padded = [a - b for a, b in zip(o.rank_routes, m.rank_routes or [0] * len(o.rank_routes))]
        total += n * sum(padded)
        to_slowest += n * padded[o.slowest_rank] if o.slowest_rank >= 0 else 0
    return to_slowest / total if total else None


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


def measure_ep_step(p: Params, bench, device_type: str, timing: Timing, distinct: Sequence[StepPadding],
            counts: Sequence[int], replay_steps: Sequence[StepPadding],
            progress: Callable[..., None] | None = None) -> tuple[dict[str, Any], list[dict[str, SideStep]]]:
    """(info.ep_step, per distinct step {side: SideStep}). `progress(done, total, what)`: RunContext.progress."""
    t0 = time.perf_counter()
    progress = progress or (lambda done, total, what, detail="": None)
    layout = layout_of(p)
    routes = StepRoutes(p, bench.device, layout)
    routed = routes.prepare(list(distinct) + list(replay_steps),
                            lambda i, n: progress(i, n, "EP step: source slots routed"))
    timer = _Counted(RankTimer(p, bench.device, timing), progress)
    budget = p.knobs(ServingKnobs).ep_rank_timings
    budget = budget if budget is not None else DEFAULT_RANK_TIMINGS[device_type]
    contests, read = _contests(distinct, counts, layout, routes)
    timer.expect(min(budget, len({w for c in contests for w in c.workloads if w.rows})),
                 "EP step: rank workloads timed")
    rank_time, times_info = plan_rank_times(contests, timer, budget, launch_of(p, bench.device), REPLAY_TOLERANCE,
                                            complete=read == len(distinct))
    times_info["workloads_read_from_steps"] = read
    times_info["timer"] = {"spent_s": round(timer.timer.spent_s, 3), "timings": timer.timer.timed}
    wire_model = wire_model_of(p)
    wire = _wire_time(wire_model)
    per_step = compose_steps(distinct, layout, routes, rank_time, wire)
    tot = totals(per_step, counts)
    info: dict[str, Any] = {
        "view": "ep_step: the slowest EP rank's expert kernel plus dispatch and combine, per step",
        "placement": placement(p), "ranks_per_node": wire_model.ranks_per_node,
        "payload": {"dtype": "fp8" if p.expert_dtype == "fp8" else "bf16",
                    "dispatch_row_bytes": layout.dispatch_row_bytes, "combine_row_bytes": layout.combine_row_bytes},
        "wire": wire_model.record(), **times_info, "routed_slots": routed,
        "totals": {side: {k: round(v, 3) for k, v in tot["sums"][side].items()} for side in SIDES},
        "tax": {k: ({s: round(x, 3) for s, x in v.items()} if isinstance(v, dict) else round(v, 3))
                for k, v in tot["tax"].items()},
        "largest_step": _largest(distinct, per_step),
        "slowest_rank_padded_route_share": padded_route_share(per_step, counts),
    }
    if replay_steps:
        timer.expect(sum(len(mb.workloads) for s in replay_steps for side in SIDES
                         for mb in micro_batches(s, layout, routes, side)), "EP step: replay ranks timed")
        info["replay"] = replay_check(replay_steps, layout, routes, rank_time, timer, wire)
    info["wall_s"] = round(time.perf_counter() - t0, 3)
    return info, per_step
