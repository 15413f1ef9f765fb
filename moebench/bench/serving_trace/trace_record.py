"""The serving_trace record's info, whole and typed: what `build` constructs and writes (`to_info()`) and what
report/, plots/ and checks.py read back (`TraceRecord.from_info`). Its parts are record.py's (TraceHeadline,
EPStepRecord, ReplayRecord, ShapePlan); records written before a field existed read it as None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from moebench.bench.serving_trace.record import (PHASES, EPStepRecord, ReplayRecord, ShapePlan, TraceHeadline,
                                                 InfoRecord, model_error_label)


@dataclass
class TraceRecord(InfoRecord):
    """A serving_trace point's info: the trace and the engine, how its shapes were timed and their figures, the
    headline, the EP step, the replay, the per-step records and what each phase cost."""

    engine: dict[str, Any]
    trace: dict[str, Any]
    distinct_shapes: int
    headline: TraceHeadline
    trace_real_points: int = 0
    timed_shapes: Optional[int] = None
    replay: Optional[ReplayRecord] = None
    ep_step: Optional[EPStepRecord] = None
    phase_wall_s: Optional[dict[str, float]] = None
    shape_plan: Optional[ShapePlan] = None  # how the single-rank view's shapes were timed
    shape_mode: Optional[str] = None  # shape_plan's mode (exact, interpolated, model)
    distinct_padded_shapes: Optional[int] = None
    shape_timings: Optional[int] = None  # both sides of each timed shape
    shapes_measured: Optional[int] = None  # timed by this point; the rest of timed_shapes read from the run's store
    shapes_reused: Optional[int] = None
    layer_calls: Optional[int] = None  # over the trace
    shape_timing: Optional[dict[str, Any]] = None  # how a shape is timed: mode, iters, stat
    shapes: Optional[list[dict[str, Any]]] = None  # each distinct shape's figures (past a bound, the timed ones)
    ep_loads: Optional[str] = None  # "computed from the routing" with EP ranks
    trace_steps: Optional[list[dict[str, Any]]] = None  # every step's figures, a short trace
    distinct_step_records: Optional[list[dict[str, Any]]] = None  # each distinct step's, a longer one
    step_file: Optional[str] = None  # every step's figures as columns beside the run (steps.step_columns)
    trace_wall_s: Optional[float] = None
    run_shape: Optional[dict[str, Any]] = None  # the shape the runner's timed call runs (Case.run)

    NESTED: ClassVar[dict[str, type]] = {"headline": TraceHeadline, "replay": ReplayRecord,
                                         "ep_step": EPStepRecord, "shape_plan": ShapePlan}
    # left out of info when None; the rest are written, None or not, as readers look them up
    OPTIONAL: ClassVar[frozenset] = frozenset({"replay", "ep_step", "phase_wall_s", "timed_shapes", "shape_plan",
                                               "step_file", "run_shape"})

    def ep_step_error(self, side: Optional[str] = None) -> tuple[Optional[float], str]:
        """(relative error, its source) of the EP step's figures on `side` (None: the worse side;
        EPStepRecord.model_error)."""
        return self.ep_step.model_error(side)

    def layer_error(self, side: str) -> tuple[Optional[float], str]:
        """(relative error, its source) of one side's layer over the trace: 0 where every shape was timed, the
        shape model's held-out RMS error, the replay's difference for an interpolation, or None: unchecked."""
        mode = self.shape_plan.shape_times if self.shape_plan is not None else None
        if mode == "exact" or (mode is None and not self.trace_real_points):
            return 0.0, "every shape timed"
        if mode == "model":
            held = self.shape_plan.held_out_rms(side)
            return (None, "the shape model's error unchecked") if held is None else \
                (held, "the shape model's held-out error")
        diff = (self.replay.rel_diff or {}).get(side) if self.replay is not None else None
        return (None, "interpolated, no replay to check it") if diff is None else (diff, "the replay's difference")

    def shapes_label(self) -> str:
        """How the shapes were timed: every one, an interpolation grid, or the model with its held-out error."""
        plan = self.shape_plan
        if plan is None or plan.shape_times != "model":
            return ""
        return (f"shape model: {plan.shape_timings} of {self.distinct_shapes} shapes timed; "
                f"{model_error_label(plan.cost_model or {})}")

    @property
    def capture_list(self) -> str:
        return str(self.engine.get("capture_list"))

    @property
    def steps(self) -> int:
        return self.trace.get("steps")

    def phases_label(self) -> str:
        """What each phase cost, wall seconds ("" for a record without them)."""
        if not self.phase_wall_s:
            return ""
        return ", ".join(f"{k.replace('_', ' ')} {self.phase_wall_s[k]:.1f}" for k in PHASES
                         if k in self.phase_wall_s) + " s"
