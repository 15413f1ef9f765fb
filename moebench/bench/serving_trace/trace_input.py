"""A serving_trace point's input: the trace's distinct steps of per-DP-rank real tokens (a CSV file, an explicit
list, or a seeded distribution) and the engine the steps go through."""

from __future__ import annotations

from typing import Any

from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.inputs.engine_padding import Engine
from moebench.params import Params
from moebench.traces.capture_lists import resolve_capture_sizes
from moebench.traces.csv_trace import read_trace_file
from moebench.traces.distinct import DistinctSteps, distinct_steps
from moebench.traces.distributions import rank_tokens
from moebench.traces.knobs import TraceKnobs


def trace_tokens(p: Params) -> tuple[DistinctSteps, dict[str, Any]]:
    """(the trace's distinct steps of per-DP-rank real tokens with their counts and per-step index, where they came
    from). A trace file's table is read once, streaming; no Python object is made per step."""
    t, serving = p.knobs(TraceKnobs), p.knobs(ServingKnobs)
    if serving.trace_file is not None:
        f = read_trace_file(serving.trace_file)
        source = {"source": "file", "file": f.path, "sha256": f.sha256, "columns": f.columns}
        if f.ignored_columns:
            source["ignored_columns"] = list(f.ignored_columns)
        return f.distinct_steps(serving.dp_size), source
    if t.trace is not None:
        return distinct_steps([[int(b)] * serving.dp_size for b in t.trace]), {"source": "explicit"}
    per_rank = [rank_tokens(t.trace_distribution, t.trace_steps, t.trace_max_tokens, p.seed, rank)
                for rank in range(serving.dp_size)]
    return distinct_steps([list(step) for step in zip(*per_rank)]), {"source": t.trace_distribution}


def engine_of(p: Params) -> Engine:
    serving = p.knobs(ServingKnobs)
    return Engine(tuple(resolve_capture_sizes(p.capture_sizes)), serving.dp_size, serving.sp_size, serving.dbo)
