"""The serving_trace record, typed: what the family builds and writes into a record's `info`, and what report/ and
plots/ read back (`from_info`), so that no reader looks a figure up by a string path through nested dicts.

  (TraceRecord, the whole of info, is trace_record.py's: it holds these)
  TraceHeadline   info.headline: the single-rank view over the trace (EPHeadline: its `ep_step`, the EP step's)
  EPStepRecord    info.ep_step: how the EP step was had (placement, payload, wire, rank times), its totals and tax
  ReplayRecord    info.replay: the single-rank composition against a call-by-call replay
  EPReplayRecord  info.ep_step.replay: the EP composition against every rank timed afresh

`to_info()` gives the JSON a record holds (optional parts left out when absent); `from_info(d)` reads it back,
`from_info(x.to_info()) == x`. A replay states its `tolerance` and its verdict per side, `within_tolerance`
(records from before it held `within_5pct`, a 5% tolerance: read as such).
Imports nothing of moebench but moebench.records (SIDES): the family builds these, report/ and plots/ read them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from moebench.records import SIDES  # noqa: F401  (the family and its readers import it from here)
LEGACY_TOLERANCE = 0.05  # what `within_5pct` meant in records written before `tolerance` was recorded


class InfoRecord:
    """to_info / from_info over the dataclass's fields; NESTED: fields holding a record of their own, OPTIONAL:
    fields left out of info when None (as the family leaves them out)."""

    NESTED: ClassVar[dict[str, type]] = {}
    OPTIONAL: ClassVar[frozenset] = frozenset()

    def to_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and f.name in self.OPTIONAL:
                continue
            out[f.name] = v.to_info() if isinstance(v, InfoRecord) else v
        return out

    @classmethod
    def from_info(cls, info: dict[str, Any]):
        kw = {}
        for f in fields(cls):  # type: ignore[arg-type]
            v = info.get(f.name)
            nested = cls.NESTED.get(f.name)
            kw[f.name] = nested.from_info(v) if nested is not None and isinstance(v, dict) else v
        return cls(**kw)


def within_tolerance(rel_diff: Optional[float], tolerance: float) -> bool:
    """A replay's verdict on one figure: its relative difference is known and at most the tolerance."""
    return rel_diff is not None and rel_diff <= tolerance


def _legacy_verdict(info: dict[str, Any]) -> dict[str, Any]:
    """A replay's info with `within_tolerance` and `tolerance`, also for a record that held `within_5pct`."""
    if "within_tolerance" in info or "within_5pct" not in info:
        return info
    out = {k: v for k, v in info.items() if k != "within_5pct"}
    return {**out, "within_tolerance": info["within_5pct"], "tolerance": LEGACY_TOLERANCE}


@dataclass
class ReplayRecord(InfoRecord):
    """info.replay: the trace's first steps replayed call by call against their composition (layer time, and
    the padding time and tax both ways)."""

    steps: int
    calls: int
    composed_us: dict[str, float]
    replayed_us: dict[str, float]
    rel_diff: dict[str, Optional[float]]
    wall_s: float
    within_tolerance: dict[str, bool]
    tolerance: float
    composed_padding_us: dict[str, float]
    replayed_padding_us: dict[str, float]
    composed_tax: dict[str, Optional[float]]
    replayed_tax: dict[str, Optional[float]]

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> "ReplayRecord":
        return super().from_info(_legacy_verdict(info))


@dataclass
class EPReplayRecord(InfoRecord):
    """info.ep_step.replay: per side, the expert and step time composed (the run's rank times) and replayed (every
    rank timed afresh), their relative differences and the verdict."""

    steps: int
    composed: dict[str, dict[str, float]]
    replayed: dict[str, dict[str, float]]
    rel_diff: dict[str, dict[str, Optional[float]]]
    within_tolerance: dict[str, bool]
    tolerance: float
    wall_s: float

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> "EPReplayRecord":
        return super().from_info(_legacy_verdict(info))

    def worst(self, side: str) -> Optional[float]:
        """The larger relative difference of the side's two figures (None: neither known)."""
        return max((v for v in (self.rel_diff.get(side) or {}).values() if v is not None), default=None)

    def verdict(self) -> str:
        """Per side, oblivious first: yes, or NO with how far off."""
        parts = []
        for side in ("oblivious", "masked"):
            ok, worst = self.within_tolerance.get(side), self.worst(side)
            parts.append(f"{side} {'yes' if ok else 'NO'}" + ("" if ok or worst is None else
                                                              f" ({100 * worst:.1f}% off)"))
        return ", ".join(parts)


@dataclass
class RankPlan(InfoRecord):
    """How the EP ranks' times were had (rank_plan.plan_rank_times): every distinct workload timed (`timed`), or a
    cost model (`model`) fitted to a design and decisive rounds, with its cost_model record (per launch its
    coefficients and cross-validated error; the rounds' held-out error against the tolerance)."""

    rank_times: str
    distinct_workloads: int
    rank_timings: int
    wall_s: float
    design_timings: Optional[int] = None
    decisive_timings: Optional[int] = None
    decisive_rounds: Optional[int] = None
    cost_model: Optional[dict[str, Any]] = None
    decided_by_timing_share: Optional[float] = None
    timed_rows_max: Optional[int] = None
    untimeable_workloads: Optional[int] = None
    timer: Optional[dict[str, Any]] = None  # the timer's host seconds and timings (ep_measure)
    reused_timings: Optional[int] = None  # workloads an earlier point of the run timed at this layer point
    stopped_by: Optional[str] = None  # the decisive rounds' end: budget, candidates (none left) or seconds

    OPTIONAL: ClassVar[frozenset] = frozenset({
        "design_timings", "decisive_timings", "decisive_rounds", "cost_model", "decided_by_timing_share",
        "timed_rows_max", "untimeable_workloads", "timer", "reused_timings", "stopped_by"})
    OWN = ("rank_times", "distinct_workloads", "rank_timings", "cost_model")  # EPStepRecord's; the rest: rank_plan

    def rest(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_info().items() if k not in self.OWN}


@dataclass
class ShapePlan(InfoRecord):
    """How the single-rank view's shapes were timed (shape_cost.plan_shape_times, or the interpolation grid):
    every distinct shape (`exact`), an interpolation grid (`interpolated`), or a designed set and the shapes that
    weigh most with a cost model reading the rest (`model`: its cost_model record, per side its held-out error)."""

    shape_times: str
    distinct_shapes: int
    shape_timings: int
    wall_s: Optional[float] = None
    design_timings: Optional[int] = None
    weighted_timings: Optional[int] = None
    cost_model: Optional[dict[str, Any]] = None
    timed_share: Optional[float] = None
    timed_rows_max: Optional[int] = None
    untimeable_shapes: Optional[int] = None

    OPTIONAL: ClassVar[frozenset] = frozenset({"wall_s", "design_timings", "weighted_timings", "cost_model",
                                               "timed_share", "timed_rows_max", "untimeable_shapes"})

    def held_out_rms(self, side: str) -> Optional[float]:
        """The shape model's held-out RMS relative error on one side (None: no model, or no held-out round)."""
        return (((self.cost_model or {}).get("held_out") or {}).get(side) or {}).get("rms_rel")


@dataclass
class EPHeadline(InfoRecord):
    """info.headline.ep_step: the EP step over the trace per side, the tax of padding and its split."""

    step_us: dict[str, float]
    experts_us: dict[str, float]
    mean_rank_us: dict[str, float]
    straggler_wait_us: dict[str, float]
    wire_us: dict[str, float]
    dispatch_us: dict[str, float]
    combine_us: dict[str, float]
    padding_tax: Optional[float]
    tax_split_us: dict[str, float]
    slowest_rank_padded_route_share: Optional[float]
    rank_times: str
    # per side, the distribution of a step's time over the trace's steps: {p50, p99, max} (us)
    step_percentiles_us: Optional[dict[str, dict[str, float]]] = None

    OPTIONAL: ClassVar[frozenset] = frozenset({"step_percentiles_us"})


@dataclass
class TraceHeadline(InfoRecord):
    """info.headline: the single-rank view over the trace (each distinct step weighted by its count)."""

    layer_us: dict[str, float]
    real_only_us: dict[str, float]
    padding_us: dict[str, float]
    padding_tax: dict[str, Optional[float]]
    recovered_us: float
    recovered_share: Optional[float]
    view: str = ""
    real_tokens: int = 0
    padded_rows: int = 0
    padding_row_share: Optional[float] = None
    padding_gemm_rows: dict[str, int] = field(default_factory=dict)
    ep_excess_routes: dict[str, float] = field(default_factory=dict)
    ep_excess_from_padding: Optional[float] = None
    jit_compiles: dict[str, Optional[int]] = field(default_factory=dict)
    noise: Optional[dict[str, Any]] = None
    ep_step: Optional[EPHeadline] = None
    # per side, the distribution of a step's layer time (its calls') over the trace's steps: {p50, p99, max} (us)
    step_percentiles_us: Optional[dict[str, dict[str, float]]] = None

    NESTED: ClassVar[dict[str, type]] = {"ep_step": EPHeadline}
    OPTIONAL: ClassVar[frozenset] = frozenset({"ep_step", "step_percentiles_us"})

    def within_noise(self, *path: str) -> Optional[bool]:
        """The noise verdict at `path` under noise.within_noise (None: unknown, or a record without it)."""
        v: Any = (self.noise or {}).get("within_noise") or {}
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v


@dataclass
class EPStepRecord(InfoRecord):
    """info.ep_step: how the EP step was had and what it came to over the trace."""

    view: str
    placement: str
    ranks_per_node: int
    payload: dict[str, Any]
    wire: dict[str, Any]
    rank_times: str
    distinct_workloads: int
    rank_timings: int
    wall_s: float
    workloads_read_from_steps: int
    routed_slots: int
    totals: dict[str, dict[str, float]]
    tax: dict[str, Any]
    largest_step: dict[str, Any]
    slowest_rank_padded_route_share: Optional[float]
    cost_model: Optional[dict[str, Any]] = None
    # how the rank times were had: the design and decisive timings, the share of the expert time they decide, the
    # timer's own cost (rank_plan.plan_rank_times)
    rank_plan: Optional[dict[str, Any]] = None
    replay: Optional[EPReplayRecord] = None
    # masked steps whose figures an earlier point of the run composed (masked_steps.py; None: not shared here)
    masked_steps_shared: Optional[int] = None
    # the card the rank times came from, where the wire figures came from, and a line when the two differ
    rank_card: Optional[str] = None
    wire_card: Optional[str] = None
    card_note: Optional[str] = None

    NESTED: ClassVar[dict[str, type]] = {"replay": EPReplayRecord}
    OPTIONAL: ClassVar[frozenset] = frozenset({"cost_model", "rank_plan", "replay", "card_note",
                                               "masked_steps_shared"})

    def model_error(self, side: Optional[str] = None) -> tuple[Optional[float], str]:
        """(relative error, its source) of the EP step's figures on `side` (None: the worse side): 0 where every rank
        workload was timed, the rank model's held-out RMS error, None where that is unchecked (every timing went to
        the model's design); and where the replay (its steps' every rank timed afresh) differs from the
        composition by more, that difference: a figure is no surer than its own check says."""
        if self.rank_times == "timed":
            error, source = 0.0, "every rank workload timed"
        else:
            error = ((self.cost_model or {}).get("held_out") or {}).get("rms_rel")
            source = ("the rank model's held-out error" if error is not None
                      else "the rank model's error unchecked (every timing went to its design)")
        replayed = None
        if self.replay is not None:
            worst = [self.replay.worst(s) for s in ([side] if side else SIDES)]
            replayed = max((w for w in worst if w is not None), default=None)
        if replayed is not None and (error is None or replayed > error):
            return replayed, f"the EP replay's difference ({self.replay.steps} steps, every rank timed afresh)"
        return error, source

    def wire_label(self) -> str:
        """The wire model by name and figures: NVLink and NIC bandwidth and latency, ranks per node, overheads."""
        wire = self.wire or {}
        intra, inter = wire.get("intra") or {}, wire.get("inter") or {}
        if not intra:
            return f"{wire.get('kind', 'model')} {wire.get('name', '?')}"
        return (f"{wire.get('kind', 'model')} {wire.get('name', '?')}: NVLink {intra.get('bandwidth_gbps'):g} GB/s + "
                f"{intra.get('latency_us'):g} us, NIC {inter.get('bandwidth_gbps'):g} GB/s + "
                f"{inter.get('latency_us'):g} us, {wire.get('ranks_per_node')} ranks a node, overheads "
                f"{wire.get('dispatch_overhead_us'):g} / {wire.get('combine_overhead_us'):g} us")

    def replay_label(self) -> str:
        return self.replay.verdict() if self.replay is not None else "not run"

    def rank_times_label(self) -> str:
        """How the rank times were had: every workload timed, or the model with its held-out error; the workloads
        read from the run's earlier points, and rounds cut by ep_rank_seconds, said."""
        plan = self.rank_plan or {}
        reused = f", {plan['reused_timings']} read from the run's earlier points" if plan.get("reused_timings") else ""
        if self.rank_times != "model" or not self.cost_model:
            return f"{self.rank_times} ({self.distinct_workloads} workloads{reused})"
        decided, cut = plan.get("decided_by_timing_share"), plan.get("stopped_by") == "seconds"
        share = f"; {100 * decided:.0f}% of the expert time decided by timed ranks" if decided is not None else ""
        return (f"model ({self.rank_timings} of {self.distinct_workloads} workloads timed{reused}"
                f"{'; rounds stopped at ep_rank_seconds' if cut else ''}; {model_error_label(self.cost_model)}{share})")


def model_error_label(cost_model: dict[str, Any]) -> str:
    """A cost model's held-out error against its tolerance, in words (one side's, or each side's)."""
    held, tol = cost_model.get("held_out") or {}, cost_model.get("tolerance")
    if "rms_rel" in held:
        held = {"": held}
    parts = [f"{side + ' ' if side else ''}{100 * h['rms_rel']:.1f}% RMS" for side, h in held.items()
             if h and h.get("rms_rel") is not None]
    if not parts:
        return ("its error unchecked: every timing went to the design (raise the budget for held-out rounds: "
                "ep_rank_timings for the rank model, trace_shape_timings for the shape model)")
    verdict = "within" if cost_model.get("within_tolerance") else "over"
    return f"held-out error {', '.join(parts)}, {verdict} {100 * tol:.0f}%" if tol else f"held-out {', '.join(parts)}"


# info.phase_wall_s: routing (the shapes' routing figures, the EP step's source slots), shapes (timed), rank_workloads
# (timed, the model fitted), replay (both checks), host_composition (the trace, its padding, the composition, the
# per-step records and step file), total (the point's build, all of these and what is between them)
PHASES = ("routing", "shapes", "rank_workloads", "replay", "host_composition", "total")


def card_note(rank_card: str, wire_gpu: str, wire_measured_on: str) -> Optional[str]:
    """One line where the rank times and the wire figures come from different cards, else None."""
    if not wire_gpu or rank_card == wire_gpu:
        return None
    return (f"the rank times are from {rank_card}, the wire figures from {wire_measured_on or wire_gpu}: "
            "the step mixes two cards")


class PhaseClock:
    """Wall seconds per phase of a point (PHASES; `total` since the clock was made): `with clock.phase(name):`."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.wall_s = {k: 0.0 for k in PHASES if k != "total"}

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.wall_s[name] += time.perf_counter() - t

    def record(self) -> dict[str, float]:
        return {**{k: round(v, 3) for k, v in self.wall_s.items()}, "total": round(time.perf_counter() - self.t0, 3)}
