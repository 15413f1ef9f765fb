"""The capture-list search priced by the EP step (what a deployment with EP ranks runs): every distinct step at every
candidate size it can pad to, composed by the padding tax's own EP step (ep_measure.measure_ep_step: the source
slots' routing, the rank plan and its held-out error, the wire model, the run's rank timings shared through
rank_timing.RankStore), per side.

Unlike the single-rank layer, the EP step is not a sum over DP ranks: every source of a step dispatches together and
the step waits for its slowest EP rank, so a step's price at a padded size is its own composition. The priced
table is built from "virtual steps": for candidate c_j, each step whose (lifted) maximum is at most c_j padded to
c_j (step_calls under the one-size list (c_j,)); each step run eagerly (the list (1,): every DP rank at its own
tokens, the DP max above); and each named list's steps under that list. They are composed in one pass, so a step
priced at c_j is priced the same wherever it is read: a chosen list's figure is read off the table, and a named
list's is its own steps' (the same compositions). A step run eagerly adds, per source (one GPU), its micro-batches'
layer calls x what an eager call costs over its graph replay (capture_pricing.eager_price): the sources launch in
parallel, so the step waits for one source's launches, not the sum.

Cost: sum over steps of the candidates at or above their maximum (`pairs`), plus the eager and named steps; past
EP_PAIRS_MAX the EP step is not priced and the record says why (a long trace's search then ranks by the layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.ep_measure import measure_ep_step
from moebench.bench.serving_trace.record import SIDES, PhaseClock
from moebench.bench.serving_trace.step_calls import StepCalls, step_calls
from moebench.inputs.engine_padding import Engine
from moebench.params import Params, Timing
from moebench.traces.capture_search import EngineShape, PricedTrace, candidate_sizes, lifted, live_steps

EP_PAIRS_MAX = 2_000_000  # (step, candidate) pairs composed (~0.1 ms of host time each at EP 64 on 2 cores)


def pairs_of(steps: np.ndarray, engine: EngineShape, keep: Sequence[int] = ()) -> int:
    """How many (distinct step, candidate size) pairs the EP pricing composes: each step at every candidate at or
    above its lifted maximum."""
    candidates = candidate_sizes(steps, engine, keep)
    steps, _ = live_steps(steps, np.ones(len(steps), np.int64))
    group = np.searchsorted(candidates, lifted(steps.max(axis=1), engine))
    return int((candidates.size - group).sum())


def not_priced_reason(p: Params, steps: np.ndarray, engine: EngineShape, keep: Sequence[int] = ()) -> str | None:
    """Why the search does not price the EP step of this point (None: it does)."""
    if p.ep_size <= 1:
        return "no EP ranks (ep_size 1): the layer is the step"
    pairs = pairs_of(steps, engine, keep)
    if pairs > EP_PAIRS_MAX:
        return f"{pairs:,} (step, candidate) pairs past {EP_PAIRS_MAX:,}: the EP step is not priced, the layer is"
    return None


def _concat(parts: Sequence[StepCalls]) -> StepCalls:
    return StepCalls(*(np.concatenate([getattr(c, f) for c in parts]) for f in StepCalls.__dataclass_fields__))


@dataclass
class _Blocks:
    """The virtual steps in one StepCalls, and where each block lies in it."""

    calls: StepCalls
    weights: np.ndarray  # each virtual step's count in the trace
    padded: list[tuple[int, np.ndarray, slice]]  # (candidate index j, the live steps padded to it, their rows)
    eager: slice
    named: dict[str, slice]


def _blocks(steps: np.ndarray, counts: np.ndarray, group: np.ndarray, candidates: np.ndarray, engine: EngineShape,
            named: Mapping[str, Sequence[int]]) -> _Blocks:
    parts, weights, padded, named_at = [], [], [], {}
    at = 0

    def add(real: np.ndarray, w: np.ndarray, sizes: Sequence[int]) -> slice:
        nonlocal at
        parts.append(step_calls(real, Engine(tuple(sorted(int(s) for s in sizes)), engine.dp_size, engine.sp_size,
                                             engine.dbo)))
        weights.append(w)
        at += len(w)
        return slice(at - len(w), at)

    for j, size in enumerate(candidates.tolist()):
        idx = np.flatnonzero(group <= j)
        padded.append((j, idx, add(steps[idx], counts[idx], (size,))))
    eager = add(steps, counts, (1,))  # nothing padded above one row: every DP rank at its own tokens
    for name, sizes in named.items():
        named_at[name] = add(steps, counts, sizes)
    return _Blocks(_concat(parts), np.concatenate(weights), padded, eager, named_at)


@dataclass
class EPPriced:
    """The EP step's priced table per side, the named lists' EP figures, the EP step's record over every virtual
    step (its rank plan, model and error) and the noise two lists must differ by to be told apart."""

    priced: dict[str, PricedTrace]
    named: dict[str, dict[str, Any]]
    record: Any  # record.EPStepRecord
    noise_rel: float | None
    noise_source: str
    eager_launch: dict[str, np.ndarray]  # per side, each group's eager launches (in its `eager` price)
    pairs: int
    virtual_steps: int

    def chosen_figures(self, side: str, sizes: Sequence[int]) -> dict[str, float]:
        """A list of candidates' figures on one side, read off the priced table: each group at the smallest listed
        size at or above its candidate, or eagerly above the largest (what the search summed)."""
        priced = self.priced[side]
        listed = np.searchsorted(priced.candidates, np.asarray(sorted(sizes), np.int64))
        # each group's padded candidate: the first listed index >= g (n: none, the group runs eagerly)
        n = priced.candidates.size
        first = np.full(n + 1, n, np.int64)
        first[listed] = listed
        first = np.minimum.accumulate(first[::-1])[::-1][:n]
        padded = first < n
        g = np.arange(n)
        ep_us = float(priced.padded[g[padded], first[padded]].sum() + priced.eager[~padded].sum())
        launch_us = float(self.eager_launch[side][~padded].sum())
        return {"time_us": ep_us, "ep_step_us": ep_us - launch_us, "eager_launch_us": launch_us}


def price_ep(p: Params, device: torch.device, timing: Timing, steps: np.ndarray, counts: np.ndarray,
             engine: EngineShape, keep: Sequence[int], named: Mapping[str, Sequence[int]],
             eager_call_us: Mapping[str, float], clock: PhaseClock, progress=None,
             known: dict | None = None, masked_steps=None) -> EPPriced:
    """Both sides' EP-step PricedTrace (the search's input) and the named lists' EP figures (module docstring)."""
    steps, counts = live_steps(steps, counts)
    candidates = candidate_sizes(steps, engine, keep)
    n = candidates.size
    group = np.searchsorted(candidates, lifted(steps.max(axis=1), engine))
    with clock.phase("host_composition"):
        blocks = _blocks(steps, counts, group, candidates, engine, named)
    record, columns = measure_ep_step(p, device, timing, blocks.calls, blocks.weights, [], clock, progress, known,
                                      masked_steps)
    launches = blocks.calls.present.sum(axis=1)  # one source's layer calls: its micro-batches
    priced, eager_launch, named_figs = {}, {}, {name: {"graphs": len(sizes)} for name, sizes in named.items()}
    for side in SIDES:
        step_us = columns.sides[side]["step_us"]
        table = np.zeros((n, n))
        for j, idx, rows in blocks.padded:
            np.add.at(table[:, j], group[idx], counts[idx] * step_us[rows])
        e = blocks.eager
        eager, launch = np.zeros(n), np.zeros(n)
        np.add.at(launch, group, counts * launches[e] * eager_call_us[side])
        np.add.at(eager, group, counts * step_us[e])
        eager += launch
        eager_launch[side] = launch
        priced[side] = PricedTrace(candidates, np.bincount(group, weights=counts, minlength=n).astype(np.int64),
                                   table, eager)
        for name, sizes in named.items():
            at = blocks.named[name]
            above = steps.max(axis=1) > (max(sizes) if sizes else 0)
            ep_us = float((counts * step_us[at]).sum())
            launch_us = float((counts * above * launches[at] * eager_call_us[side]).sum())
            named_figs[name][side] = {"time_us": ep_us + launch_us, "ep_step_us": ep_us, "eager_launch_us": launch_us}
    noise, source = record.model_error()
    return EPPriced(priced, named_figs, record, noise, source, eager_launch,
                    int(sum(len(idx) for _, idx, _ in blocks.padded)), blocks.calls.num_steps)

