"""The sweep keys of the trace of batch sizes, declared and checked here (moebench.params.register_knobs):
`TraceKnobs`, read by bench.jit_trace, bench.capacity_wire and bench.serving_trace: an explicit list, or
trace_steps sizes drawn (seeded) from trace_distribution in [1, trace_max_tokens]. The serving engine's keys are
the serving trace's own (moebench.bench.serving_trace.knobs: ServingKnobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moebench.params import Params, register_knobs

TRACE_DISTRIBUTIONS = ("uniform", "decode_prefill", "lognormal", "chat", "mixed", "prefill_heavy")


@register_knobs
@dataclass(frozen=True)
class TraceKnobs:
    trace: Optional[list] = None  # explicit per-step batch sizes
    trace_steps: int = 100
    trace_distribution: str = "decode_prefill"
    trace_max_tokens: int = 8192

    KEYED_AT_DEFAULT = frozenset({"trace", "trace_steps", "trace_distribution", "trace_max_tokens"})
    CHOICES = {"trace_distribution": TRACE_DISTRIBUTIONS}

    @staticmethod
    def unused(fixed: dict) -> dict[str, str]:
        """{key: why} for the trace keys a sweep's fixed values set that its trace does not read: a trace file or an
        explicit list supersedes the drawn trace's keys (the run's header says so beside them)."""
        if fixed.get("trace_file") is not None:
            source = "trace_file"
        elif fixed.get("trace") is not None:
            source = "trace"
        else:
            return {}
        drawn = ["trace_steps", "trace_distribution", "trace_max_tokens"]
        drawn += ["trace"] if source == "trace_file" else []
        return {k: f"not used: {source} gives the trace" for k in drawn if k in fixed}

    def problem(self, p: Params) -> str | None:
        for k in ("trace_steps", "trace_max_tokens"):
            if getattr(self, k) < 1:
                return f"{k}: must be >= 1, got {getattr(self, k)}"
        if self.trace is not None and (not self.trace or min(self.trace) < 1):
            return "trace: must be a non-empty list of positive batch sizes"
        return None
