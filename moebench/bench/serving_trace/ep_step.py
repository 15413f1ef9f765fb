"""The EP step of a serving trace: the slowest EP rank's expert work plus the wire, per step and side; arithmetic.

Placement. Every layer call of a step (a DP rank x SP rank x micro-batch, moebench.inputs.engine_padding) is a
source on one EP rank: with DP attention and expert parallelism every GPU holds one DP x SP source. When the EP
group is larger than DP x SP, the trace's DP ranks stand for each of ep_size / (DP x SP) such groups (`replicas`:
the same token counts, each source its own routing); when smaller, source `slot` sits on rank slot mod ep_size.
A source's slot is replica * DP * SP + dp_rank * sp_size + sp_rank.
Per micro-batch m and side (masked: padded rows route nowhere; oblivious: they are routed like real rows), from
each call's routing (`CallRoutes`: routes per expert, rows sent to each EP rank; exact, measure.imbalance's counts):
  rank r's workload  the rows it receives from every source and the routes to each of its experts (rank_cost.py)
  experts_us(m)      max over r of T_r, T_r its workload's time; mean_us(m) the mean over r; slowest its argmax
  dispatch_us(m)     the wire model's time for bytes[src][dst] = rows src sends dst x dispatch row bytes
  combine_us(m)      the same with the matrix transposed x combine row bytes (every received row goes back)
This module composes one step at a time: the replay, the largest step's record and the reference that
ep_arrays (every distinct step at once, what a run composes) is tested against. Each micro-batch is built once per
step and side (`micro_batches`) and priced at once (`MicroBatch.priced`: its wire times and off-rank bytes, the byte
matrices dropped); `StepMicroBatches` keeps them for the steps read more than once.
The step: sum over m of dispatch + experts + combine; with DBO (two micro-batches) one micro-batch's wire overlaps
the other's experts:  step = d0 + max(c0, d1) + max(x0, c1) + x1  (d dispatch, c experts, x combine).
The tax of padding (oblivious minus masked: masked padded rows add no route, no row, no byte) splits into
  gemm_us       sum over m of the mean rank's added time (expert work on padded routes, spread evenly)
  straggler_us  sum over m of the added wait for the slowest rank: (max - mean) oblivious - (max - mean) masked
  wire_us       sum over m of the added dispatch + combine time
  overlap_us    with DBO, what the overlap hides of those (the rest of the step difference; 0 without DBO)
which add up to the step difference. The router and the per-source reduce are not in the step (the single-rank
layer view times them); `compose_steps` is tested against stand-in timers in tests.bench.serving_trace.test_ep_step.py.
`placement`, `layout_of`: the sources on the EP ranks of a point; `largest_step`, `padded_route_share`: figures of
the composed steps the record states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.rank_cost import Workload
from moebench.bench.serving_trace.record import SIDES
from moebench.dispatch.wire_model import combine_row_bytes, dispatch_row_bytes
from moebench.inputs.engine_padding import StepPadding
from moebench.params import EPLayout, Params
RankTime = Callable[[Workload], float]
# (phase "dispatch" | "combine", bytes[src][dst]) -> microseconds
WireTime = Callable[[str, list[list[int]]], float]


@dataclass(frozen=True)
class CallRoutes:
    """One layer call's routing, one side: routes to each of the E experts, rows sent to each EP rank."""

    expert_routes: tuple[int, ...]
    rank_rows: tuple[int, ...]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Both as int64 arrays, made once (a call is read by every step that holds it)."""
        got = self.__dict__.get("_arrays")
        if got is None:
            got = (np.asarray(self.expert_routes, dtype=np.int64), np.asarray(self.rank_rows, dtype=np.int64))
            object.__setattr__(self, "_arrays", got)
        return got


@dataclass(frozen=True)
class EPStepLayout(EPLayout):
    """The EP layout (ownership of the experts: EPLayout's ep_size, num_experts, local_experts) as the EP step
    places its sources on it: SP ranks per DP rank, the bytes of a row on the wire each way, DBO, and `replicas`
    (DP x SP groups the EP group holds: ep_size / (DP x SP) when larger). `rank` is unused (0): the step sees
    every rank."""

    sp_size: int = 1
    dispatch_row_bytes: int = 0
    combine_row_bytes: int = 0
    dbo: bool = False
    replicas: int = 1

    def sources(self, dp_size: int) -> int:
        return dp_size * self.sp_size

    def slot(self, replica: int, dp_size: int, dp_rank: int, sp_rank: int) -> int:
        return replica * dp_size * self.sp_size + dp_rank * self.sp_size + sp_rank


def layout_of(p: Params) -> EPStepLayout:
    payload = "fp8" if p.expert_dtype == "fp8" else "bf16"
    serving = p.knobs(ServingKnobs)
    return EPStepLayout(0, p.ep_size, p.num_experts, sp_size=serving.sp_size,
                        dispatch_row_bytes=dispatch_row_bytes(p.hidden, p.top_k, payload),
                        combine_row_bytes=combine_row_bytes(p.hidden), dbo=serving.dbo,
                        replicas=max(1, p.ep_size // (serving.dp_size * serving.sp_size)))


def placement(p: Params) -> str:
    serving = p.knobs(ServingKnobs)
    sources = serving.dp_size * serving.sp_size
    if sources == p.ep_size:
        return f"one source (DP rank x SP rank) on each of the {p.ep_size} EP ranks"
    if sources < p.ep_size:
        return (f"{p.ep_size // sources} DP groups of DP x SP = {sources} sources, one on each of the {p.ep_size} EP "
                f"ranks: each group the trace's token counts, its own routing")
    return f"{sources} sources (DP x SP) on {p.ep_size} EP ranks, source s on rank s mod {p.ep_size}"


def placement_problem(ep_size: int, dp_size: int, sp_size: int) -> str | None:
    """Why DP x SP sources do not tile ep_size EP ranks, or None."""
    sources = dp_size * sp_size
    if ep_size % sources and sources % ep_size:
        return (f"ep_size: the EP step places DP x SP = {sources} sources on {ep_size} EP ranks; one must divide "
                f"the other")
    return None


def call_routes(ids: torch.Tensor, num_experts: int, ep_size: int) -> CallRoutes:
    """A routing [T, K] (-1: none) as routes per expert and rows with a route to each EP rank (measure.imbalance)."""
    from moebench.measure.imbalance import rank_rows

    ids = ids.to(torch.int64)
    expert_routes = torch.bincount(ids[ids >= 0], minlength=num_experts)
    return CallRoutes(tuple(int(v) for v in expert_routes.tolist()),
                      tuple(rank_rows(ids, EPLayout(0, ep_size, num_experts))))


# routes of a call: (rows, real, slot, side) -> CallRoutes
RoutesOf = Callable[[int, int, int, str], CallRoutes]


@dataclass
class MicroBatch:
    """One micro-batch of one side: what each EP rank received and the bytes on the wire."""

    counts: np.ndarray  # int64 [R, E/R]: routes to each rank's local experts
    received: np.ndarray  # int64 [R]: rows each rank received
    dispatch_bytes: np.ndarray  # [src][dst]
    combine_bytes: np.ndarray

    @classmethod
    def of_workloads(cls, workloads: Sequence[Workload], dispatch_bytes, combine_bytes) -> "MicroBatch":
        return cls(np.asarray([w.counts for w in workloads], dtype=np.int64),
                   np.asarray([w.rows for w in workloads], dtype=np.int64),
                   np.asarray(dispatch_bytes), np.asarray(combine_bytes))

    @property
    def workloads(self) -> list[Workload]:
        return [Workload(int(r), tuple(c)) for r, c in zip(self.received.tolist(), self.counts.tolist())]

    def off_rank_bytes(self, phase: str) -> int:
        m = self.dispatch_bytes if phase == "dispatch" else self.combine_bytes
        return int(m.sum() - np.trace(m))

    def priced(self, wire_time: WireTime) -> "PricedMicroBatch":
        """Its rank workloads with the wire's times and off-rank bytes (the byte matrices dropped)."""
        return PricedMicroBatch(self.counts, self.received, wire_time("dispatch", self.dispatch_bytes),
                                wire_time("combine", self.combine_bytes), self.off_rank_bytes("dispatch"),
                                self.off_rank_bytes("combine"))


@dataclass
class PricedMicroBatch:
    """One micro-batch of one side as the composition reads it: the rank workloads and the wire's times."""

    counts: np.ndarray  # int64 [R, E/R]
    received: np.ndarray  # int64 [R]
    dispatch_us: float
    combine_us: float
    dispatch_bytes: int  # off-rank bytes summed over the ranks
    combine_bytes: int

    @property
    def workloads(self) -> list[Workload]:
        return [Workload(int(r), tuple(c)) for r, c in zip(self.received.tolist(), self.counts.tolist())]


def micro_batches(step: StepPadding, layout: EPStepLayout, routes_of: RoutesOf, side: str) -> list[MicroBatch]:
    """The step's micro-batches (those with calls) as rank workloads and byte matrices."""
    R, epr = layout.ep_size, layout.local_experts
    dp_size = len(step.real)
    out = []
    for m in sorted({c.micro_batch for c in step.calls}):
        experts = np.zeros(layout.num_experts, dtype=np.int64)
        sent = np.zeros((R, R), dtype=np.int64)  # rows [src][dst]
        for c in step.calls:
            if c.micro_batch != m:
                continue
            for q in range(layout.replicas):
                slot = layout.slot(q, dp_size, c.dp_rank, c.sp_rank)
                per_expert, per_rank = routes_of(c.rows, c.real, slot, side).arrays()
                experts += per_expert
                sent[slot % R] += per_rank
        out.append(MicroBatch(experts.reshape(R, epr), sent.sum(axis=0), sent * layout.dispatch_row_bytes,
                              sent.T * layout.combine_row_bytes))
    return out


def dbo_step_us(parts: Sequence[tuple[float, float, float]]) -> float:
    """A step of (dispatch, experts, combine) micro-batches: serial, or the DBO overlap of two."""
    if len(parts) == 2:
        (d0, c0, x0), (d1, c1, x1) = parts
        return d0 + max(c0, d1) + max(x0, c1) + x1
    return sum(d + c + x for d, c, x in parts)


@dataclass
class SideStep:
    """One step, one side."""

    step_us: float = 0.0
    experts_us: float = 0.0  # sum over micro-batches of the slowest rank's time
    mean_rank_us: float = 0.0  # sum over micro-batches of the mean rank's time
    dispatch_us: float = 0.0
    combine_us: float = 0.0
    dispatch_bytes: int = 0  # off-rank bytes, summed over ranks and micro-batches
    combine_bytes: int = 0
    slowest_rank: int = -1  # of the micro-batch with the longest expert time
    slowest_us: float = 0.0
    rank_us: list[float] = field(default_factory=list)  # that micro-batch's per-rank times
    rank_routes: list[int] = field(default_factory=list)  # routes to each rank, summed over micro-batches

    @property
    def serial_us(self) -> float:
        return self.dispatch_us + self.experts_us + self.combine_us


def side_step(mbs: Sequence[PricedMicroBatch], rank_time: RankTime, dbo: bool) -> SideStep:
    out = SideStep()
    parts = []
    for mb in mbs:
        # a cost model reads every rank at once; a table of timings one workload at a time
        times = (rank_time.batch(mb.counts, mb.received) if hasattr(rank_time, "batch")
                 else [rank_time(w) for w in mb.workloads])
        slowest = max(range(len(times)), key=lambda r: times[r])
        d, x = mb.dispatch_us, mb.combine_us
        parts.append((d, times[slowest], x))
        out.experts_us += times[slowest]
        out.mean_rank_us += sum(times) / len(times)
        out.dispatch_us += d
        out.combine_us += x
        out.dispatch_bytes += mb.dispatch_bytes
        out.combine_bytes += mb.combine_bytes
        routes = mb.counts.sum(axis=1).tolist()
        out.rank_routes = [a + b for a, b in zip(out.rank_routes, routes)] if out.rank_routes else routes
        if times[slowest] >= out.slowest_us:
            out.slowest_rank, out.slowest_us, out.rank_us = slowest, times[slowest], times
    out.step_us = dbo_step_us(parts) if dbo else sum(d + c + x for d, c, x in parts)
    return out


StepMBs = Mapping[str, Sequence[PricedMicroBatch]]  # one step's priced micro-batches per side


class StepMicroBatches:
    """Each step's priced micro-batches per side, built once: kept for the steps `keep()` names (those read more
    than once: the workloads' steps, the replay's), built on the fly and dropped for the others (a long trace's
    distinct steps are composed once)."""

    def __init__(self, layout: EPStepLayout, routes_of: RoutesOf, wire_time: WireTime):
        self.layout, self.routes_of, self.wire_time = layout, routes_of, wire_time
        self.kept: dict[int, tuple[StepPadding, dict[str, list[PricedMicroBatch]]]] = {}
        self.built = 0  # micro-batch lists built (a step and side each)

    def _build(self, step: StepPadding) -> dict[str, list[PricedMicroBatch]]:
        self.built += len(SIDES)
        return {side: [mb.priced(self.wire_time) for mb in micro_batches(step, self.layout, self.routes_of, side)]
                for side in SIDES}

    def keep(self, steps: Sequence[StepPadding]) -> None:
        for s in steps:
            if id(s) not in self.kept:
                self.kept[id(s)] = (s, self._build(s))

    def __call__(self, step: StepPadding) -> dict[str, list[PricedMicroBatch]]:
        got = self.kept.get(id(step))
        return got[1] if got is not None else self._build(step)


def compose_priced(step_mbs: Sequence[StepMBs], rank_time: RankTime, dbo: bool) -> list[dict[str, SideStep]]:
    """Per step {side: SideStep} from its priced micro-batches."""
    return [{side: side_step(mbs[side], rank_time, dbo) for side in SIDES} for mbs in step_mbs]


def compose_steps(steps: Sequence[StepPadding], layout: EPStepLayout, routes_of: RoutesOf, rank_time: RankTime,
                  wire_time: WireTime) -> list[dict[str, SideStep]]:
    """Per step {side: SideStep}."""
    built = StepMicroBatches(layout, routes_of, wire_time)
    return compose_priced([built(s) for s in steps], rank_time, layout.dbo)


def tax_split(masked: SideStep, oblivious: SideStep, dbo: bool = True) -> dict[str, float]:
    """What padding adds to a step (oblivious - masked), split into GEMM work, straggler wait, wire and, with DBO,
    what the overlap hides (without DBO the three parts make the difference: the overlap is 0, not the float
    residue of the sums)."""
    gemm = oblivious.mean_rank_us - masked.mean_rank_us
    straggler = (oblivious.experts_us - oblivious.mean_rank_us) - (masked.experts_us - masked.mean_rank_us)
    wire = (oblivious.dispatch_us + oblivious.combine_us) - (masked.dispatch_us + masked.combine_us)
    total = oblivious.step_us - masked.step_us
    return {"gemm_us": gemm, "straggler_us": straggler, "wire_us": wire,
            "overlap_us": total - (gemm + straggler + wire) if dbo else 0.0, "total_us": total}


SUMMED = ("step_us", "experts_us", "mean_rank_us", "dispatch_us", "combine_us", "dispatch_bytes", "combine_bytes")


def step_totals(per_step: Sequence[Mapping[str, SideStep]], counts: Sequence[int] | None = None, dbo: bool = True
           ) -> dict:
    """Sums over the steps (each weighted by its count: a distinct step stands for `counts[i]` steps) per side,
    and the tax split of the sums."""
    counts = counts if counts is not None else [1] * len(per_step)
    # fsum: the exact sum, whatever the order (the array composition, ep_arrays, sums the same products)
    sums = {side: {k: math.fsum(n * getattr(st[side], k) for st, n in zip(per_step, counts)) for k in SUMMED}
            for side in SIDES}
    m, o = (SideStep(**{k: sums[s][k] for k in SUMMED}) for s in SIDES)
    split = tax_split(m, o, dbo)
    split["straggler_wait_us"] = {s: sums[s]["experts_us"] - sums[s]["mean_rank_us"] for s in SIDES}
    return {"sums": sums, "tax": split}


def largest_step(steps: Sequence[StepPadding], per_step: Sequence[dict[str, SideStep]]) -> dict:
    """The step with the most rows: per side its slowest rank, that rank's time, the mean's, every rank's."""
    if not steps:
        return {}
    i = max(range(len(steps)), key=lambda j: (sum(c.rows for c in steps[j].calls), -j))
    out: dict = {"real": list(steps[i].real), "rows": sum(c.rows for c in steps[i].calls)}
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
