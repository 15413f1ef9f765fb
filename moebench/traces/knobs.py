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

    def problem(self, p: Params) -> str | None:
        for k in ("trace_steps", "trace_max_tokens"):
            if getattr(self, k) < 1:
                return f"{k}: must be >= 1, got {getattr(self, k)}"
        if self.trace is not None and (not self.trace or min(self.trace) < 1):
            return "trace: must be a non-empty list of positive batch sizes"
        return None
