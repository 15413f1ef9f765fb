"""The sweep keys of the trace families, declared and checked here (moebench.params.register_knobs):

- `TraceKnobs`: the trace of batch sizes bench.jit_trace, bench.capacity_wire and bench.serving_trace read: an
  explicit list, or trace_steps sizes drawn (seeded) from trace_distribution in [1, trace_max_tokens].
- `ServingKnobs`: the serving engine around the layer that bench.serving_trace models (DP ranks, SP ranks, dual-batch
  overlap), a user's trace file, and how much of the trace is timed one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moebench.params import Params, register_knobs
from moebench.traces.csv_trace import BUNDLED_DIR, trace_file_problem

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


@register_knobs
@dataclass(frozen=True)
class ServingKnobs:
    dp_size: int = 1  # DP ranks, each with its own real tokens per step, padded to the max across them
    sp_size: int = 1  # sequence parallelism: SP (TP) ranks each micro-batch is padded for and chunked over
    dbo: bool = False  # dual-batch overlap: two micro-batches per step
    trace_file: Optional[str] = None  # CSV of per-step token counts (one column, or one per DP rank)
    trace_replay: int = 0  # also replay the first N steps one by one (every call built and timed, no shape cache)
    trace_real_points: int = 0  # 0: time every distinct (rows, real); N: time N + 1 real counts per rows, interpolate
    # the EP step: distinct rank workloads timed one by one, beyond which a cost model is fitted to this many
    # (None: moebench.bench.serving_trace.ep_measure.DEFAULT_RANK_TIMINGS for the device)
    ep_rank_timings: Optional[int] = None

    PATHS = {"trace_file": (BUNDLED_DIR, False)}  # a file, found beside the sweep or among the bundled traces

    def problem(self, p: Params) -> str | None:
        for k in ("dp_size", "sp_size"):
            if getattr(self, k) < 1:
                return f"{k}: must be >= 1, got {getattr(self, k)}"
        for k in ("trace_replay", "trace_real_points"):
            if getattr(self, k) < 0:
                return f"{k}: must be >= 0, got {getattr(self, k)}"
        if self.ep_rank_timings is not None and self.ep_rank_timings < 1:
            return f"ep_rank_timings: must be >= 1, got {self.ep_rank_timings}"
        why = trace_file_problem(self.trace_file, self.dp_size)  # a bad file is refused here, naming its line
        return f"trace_file: {why}" if why else None
