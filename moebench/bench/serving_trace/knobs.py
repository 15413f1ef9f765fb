"""The sweep keys of the serving trace and its EP step, one knob group (moebench.params.register_knobs):
the serving engine around the layer (DP ranks, SP ranks, dual-batch overlap), a user's trace file, how much of the
trace is timed (trace_replay, trace_real_points, trace_shape_timings, ep_rank_timings, ep_rank_seconds) and the EP
step's wire (ranks_per_node, the link figures, the dispatch run the wire model is calibrated from and its path:
moebench.dispatch.wire_model).
The trace of token counts itself is TraceKnobs' (moebench.traces.knobs: jit_trace reads it too).

Two key lists are derived here from the groups, not kept by hand:
  TRACE_KEYS     the keys that shape the trace or the engine, not the layer: shapes measured at one layer point
                 are reused across points differing only by these (the shape store, shapes.py)
  config_keys()  the keys that make an engine configuration: every key but the what-if axis (capture_sizes) and
                 the ones that only say how much is measured (MEASUREMENT, and `repeat`); report/trace_tax.py finds
                 each configuration's best capture list among records equal in these
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from moebench.dispatch.pack import CapacityKnobs
from moebench.dispatch.wire_model import DEFAULT_PATH, DEFAULT_RANKS_PER_NODE, wire_settings_problem
from moebench.params import Params, register_knobs
from moebench.traces.csv_trace import BUNDLED_DIR, trace_file_problem
from moebench.traces.knobs import TraceKnobs

WIRE_FIGURE_KEYS = ("wire_intra_gbps", "wire_intra_latency_us", "wire_inter_gbps", "wire_inter_latency_us")


# what is timed when the sweep leaves the budgets unset (beyond: a model fitted to this many); the interpreter's
# budgets are a smoke test's
DEFAULT_SHAPE_TIMINGS = {"cuda": 192, "cpu": 12}
DEFAULT_RANK_TIMINGS = {"cuda": 256, "cpu": 6}
# the rank plan's seconds, after which its decisive rounds stop (None: no limit; the interpreter's budgets are a
# count of a few workloads): a GPU's heaviest workloads (prefill at EP 64: ~10^5 rows) take ~0.1 s a timing
DEFAULT_RANK_SECONDS = {"cuda": 90.0, "cpu": None}


@register_knobs
@dataclass(frozen=True)
class ServingKnobs:
    dp_size: int = 1  # DP ranks, each with its own real tokens per step, padded to the max across them
    sp_size: int = 1  # sequence parallelism: SP (TP) ranks each micro-batch is padded for and chunked over
    dbo: bool = False  # dual-batch overlap: two micro-batches per step
    trace_file: Optional[str] = None  # CSV of per-step token counts (one column, or one per DP rank)
    trace_replay: int = 0  # also replay the first N steps one by one (every call built and timed, no shape cache)
    # 0: every distinct (rows, real) timed while they number at most trace_shape_timings, else that many timed by
    # design and the rest read off the shape cost model (shape_cost.py); N > 0: N + 1 real counts timed per rows and
    # interpolated (compose.py)
    trace_real_points: int = 0
    trace_shape_timings: Optional[int] = None  # None: DEFAULT_SHAPE_TIMINGS for the device (shape_timings())
    # the EP step: distinct rank workloads timed one by one, beyond which a cost model is fitted to this many
    # (None: DEFAULT_RANK_TIMINGS for the device: rank_timings())
    ep_rank_timings: Optional[int] = None
    # the EP step: seconds after which the rank plan's decisive rounds stop, the design timed whole (None:
    # DEFAULT_RANK_SECONDS for the device: rank_seconds())
    ep_rank_seconds: Optional[float] = None
    # the EP step's wire: the deployment's GPUs per node, the links' figures (None: the model's own), the dispatch
    # run the model is calibrated from, and the path whose overheads it takes
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE
    wire_intra_gbps: Optional[float] = None  # GB/s of off-rank bytes per rank within a node (NVLink)
    wire_intra_latency_us: Optional[float] = None
    wire_inter_gbps: Optional[float] = None  # GB/s of off-rank bytes per rank between nodes (the NIC)
    wire_inter_latency_us: Optional[float] = None
    dispatch_calibration: Optional[str] = None  # a run directory of `moebench run sweeps/dispatch.yaml`
    wire_path: str = DEFAULT_PATH  # the dispatch impl of that run whose fit models dispatch and combine

    # a trace file is found beside the sweep or among the bundled traces; a calibration run as the sweep names it
    PATHS = {"trace_file": (BUNDLED_DIR, False), "dispatch_calibration": (None, True)}
    # keys that say how much is measured, not what is: records differing only in these are one configuration
    MEASUREMENT = frozenset({"trace_replay", "trace_real_points", "trace_shape_timings", "ep_rank_timings",
                             "ep_rank_seconds"})

    def shape_timings(self, device_kind: str) -> int:
        """The shapes timed before the shape model reads the rest, on a "cuda" or "cpu" device."""
        return self.trace_shape_timings or DEFAULT_SHAPE_TIMINGS[device_kind]

    def rank_timings(self, device_kind: str) -> int:
        """The rank workloads timed before the rank model reads the rest, on a "cuda" or "cpu" device."""
        return self.ep_rank_timings if self.ep_rank_timings is not None else DEFAULT_RANK_TIMINGS[device_kind]

    def rank_seconds(self, device_kind: str) -> float | None:
        """The rank plan's seconds before its decisive rounds stop, on a "cuda" or "cpu" device (None: no limit)."""
        return self.ep_rank_seconds if self.ep_rank_seconds is not None else DEFAULT_RANK_SECONDS[device_kind]

    @property
    def wire_figures(self) -> dict[str, Optional[float]]:
        return {k: getattr(self, k) for k in WIRE_FIGURE_KEYS}

    def problem(self, p: Params) -> str | None:
        for k in ("dp_size", "sp_size"):
            if getattr(self, k) < 1:
                return f"{k}: must be >= 1, got {getattr(self, k)}"
        for k in ("trace_replay", "trace_real_points"):
            if getattr(self, k) < 0:
                return f"{k}: must be >= 0, got {getattr(self, k)}"
        for k in ("ep_rank_timings", "trace_shape_timings"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                return f"{k}: must be >= 1, got {getattr(self, k)}"
        if self.ep_rank_seconds is not None and not self.ep_rank_seconds > 0:
            return f"ep_rank_seconds: must be > 0, got {self.ep_rank_seconds}"
        why = trace_file_problem(self.trace_file, self.dp_size)  # a bad file is refused here, naming its line
        if why:
            return f"trace_file: {why}"
        return wire_settings_problem(self.ranks_per_node, self.wire_figures, p.ep_size, self.dispatch_calibration,
                                     self.wire_path)


def _names(*groups: type) -> tuple[str, ...]:
    return tuple(f.name for g in groups for f in dataclasses.fields(g))


# Params keys the serving trace sets itself per shape (shapes.shape_params), and the engine's what-if axis
SHAPE_SET_KEYS = ("num_tokens", "padding_ratio", "padding_producer")
WHAT_IF_KEY = "capture_sizes"
TRACE_KEYS = frozenset(_names(ServingKnobs, TraceKnobs, CapacityKnobs) + SHAPE_SET_KEYS + (WHAT_IF_KEY,))


def config_keys(params: dict) -> list[str]:
    """The keys of a record's params that make its engine configuration, sorted (config_keys' rule above)."""
    left_out = ServingKnobs.MEASUREMENT | {WHAT_IF_KEY, "repeat"}
    return sorted(k for k in params if k not in left_out)
