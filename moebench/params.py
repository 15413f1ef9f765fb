"""The parameters of one point: `Params` (every key a sweep may put under `fixed` or `axes`), `Timing` (how a point
is timed) and `Point` (one impl at one Params, with the stable key runs are resumed and compared by); and the values
derived from Params that several layers need, each computed in one place: `EPLayout` (which EP rank owns which
experts), `padding_rows` (how many rows a padding ratio pads).

Plain frozen data, importing nothing of moebench, so that everything else can sit above it: the inputs, the
registry, the dispatch paths, the bench modules and the measurements read a point's parameters from here, while
loading and validating a sweep file (which needs the registry, the plugins and the presets) is moebench.run.sweep's job.
The values each field accepts are checked there (moebench.run.sweep.CHOICES, params_problem).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# ---------------------------------------------------------------------------------------------------------------
# Parameters of one point. Every key a sweep may put under `fixed` or `axes` is a field here; anything else is
# an unknown key. Defaults are a DeepSeek-V3-like layer.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Params:
    # token axis and padding
    num_tokens: int = 1024  # rows on one rank, padding included (for `cudagraph`: real tokens before padding)
    padding_ratio: float = 0.0  # fraction of rows that are padding (`ratio` producer: the trailing rows)
    padding_producer: str = "ratio"
    padding_fill: str = "repeat"
    mask: bool = True  # pass is_padding to mask-aware impls (False: padded rows routed like real ones)
    # cudagraph producer: a list, a name of moebench.traces.capture_lists, or None = 1,2,4,8 then multiples of 8
    # up to 512
    capture_sizes: Optional[Union[list, str]] = None
    producer_size: int = 2  # ranks of the dp / sp (TP size) / pcp producer
    # the mask the router is handed (scenarios d and g; moebench.inputs.router_mask documents both)
    pcp_mask: str = "gathered"  # pcp: the gathered mask (the fix) or the rank-local one (the size-mismatch bug)
    dbo_mask: str = "sliced"  # dbo: each micro-batch's slice (the fix), the full-batch mask, or none
    # routing
    num_experts: int = 256
    top_k: int = 8
    routing: str = "uniform"
    zipf_exponent: float = 1.2
    hot_experts: int = 1
    hot_ratio: float = 0.5  # hot_expert: share of each real token's probability mass aimed at the hot experts
    renormalize: bool = True
    bias: bool = False  # selection bias (DeepSeek-V3 e_score_correction_bias)
    scoring: str = "softmax"
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # shapes and formats
    hidden: int = 7168
    intermediate: int = 2048
    dtype: str = "bf16"
    group_size: int = 32
    scale_format: str = "ue8m0_packed"
    expert_dtype: str = "bf16"  # the layer's expert GEMMs: bf16 on the hidden states, or fp8 on the staged rows
    block_size: int = 64
    num_local_experts: Optional[int] = None  # None: num_experts / ep_size
    # expert parallelism
    ep_size: int = 1
    ep_mode: str = "real"
    capacity_policy: str = "exact"
    num_max_tokens_per_rank: int = 8192
    low_latency: bool = False  # deepep: low-latency mode instead of normal mode
    # jit_trace
    trace: Optional[list] = None  # explicit per-step batch sizes
    trace_steps: int = 100
    trace_distribution: str = "decode_prefill"
    trace_max_tokens: int = 8192
    # serving_trace: the engine around the layer, and a user's trace (moebench.traces.csv_trace)
    dp_size: int = 1  # DP ranks, each with its own real tokens per step, padded to the max across them
    sp_size: int = 1  # sequence parallelism: SP (TP) ranks each micro-batch is padded for and chunked over
    dbo: bool = False  # dual-batch overlap: two micro-batches per step
    trace_file: Optional[str] = None  # CSV of per-step token counts (one column, or one per DP rank)
    trace_replay: int = 0  # also replay the first N steps one by one (every call built and timed, no shape cache)
    trace_real_points: int = 0  # 0: time every distinct (rows, real); N: time N + 1 real counts per rows, interpolate
    # EP step: the wire model (moebench.dispatch.wire_model): the deployment's GPUs per node, the links' figures
    # (None: the model's own), the dispatch run it is calibrated from, and the path whose overheads it takes
    ranks_per_node: int = 8
    wire_intra_gbps: Optional[float] = None  # GB/s of off-rank bytes per rank within a node (NVLink)
    wire_intra_latency_us: Optional[float] = None
    wire_inter_gbps: Optional[float] = None  # GB/s of off-rank bytes per rank between nodes (the NIC)
    wire_inter_latency_us: Optional[float] = None
    dispatch_calibration: Optional[str] = None  # a run directory of `moebench run sweeps/dispatch.yaml`
    wire_path: str = "dispatch.a2a"  # the dispatch impl of that run whose fit models dispatch and combine
    # the EP step: distinct rank workloads timed one by one, beyond which a cost model is fitted to this many
    # (None: moebench.bench._trace_ep.DEFAULT_RANK_TIMINGS for the device)
    ep_rank_timings: Optional[int] = None
    # bookkeeping
    seed: int = 0
    repeat: int = 0  # a label: lets one sweep time the same point several times
    # model preset (moebench.presets): fills the layer's shape keys the sweep does not set itself; recorded
    model: Optional[str] = None
    # launch config of the impl's tuned kernel (a name from its candidate table, kernels._details.tuning); None or
    # "auto": the GPU's tuned table, else the kernel's rule. Part of the point key: `moebench tune` sweeps it.
    config: Optional[str] = None

    @property
    def num_padding(self) -> int:
        return padding_rows(self.num_tokens, self.padding_ratio)

    @property
    def local_experts(self) -> int:
        return self.num_local_experts if self.num_local_experts is not None else EPLayout.of(self).experts_per_rank

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def padding_rows(num_rows: int, padding_ratio: float) -> int:
    """How many of `num_rows` rows are padding at `padding_ratio`: round(), so half-way cases go to even (the one
    place this is computed: the producers' masks and the records must agree on it)."""
    return int(round(num_rows * padding_ratio))


def ep_split_problem(num_experts: int, ep_size: int) -> str | None:
    """Why num_experts experts cannot be split evenly over ep_size EP ranks, or None (the one place it is checked)."""
    if num_experts < 1 or ep_size < 1:
        return f"ep_size: num_experts and ep_size must be >= 1, got {num_experts}, {ep_size}"
    if num_experts % ep_size:
        return f"ep_size: {ep_size} does not divide num_experts {num_experts}"
    return None


@dataclass(frozen=True)
class EPLayout:
    """Expert ownership over the EP ranks, seen from one of them: rank r of ep_size owns the experts
    [r * E / ep_size, (r + 1) * E / ep_size). The one place experts per rank is derived; the dispatch paths, the
    imbalance figures and the simulated ranks all read it from here."""

    rank: int
    ep_size: int
    num_experts: int
    group: Any = None  # the torch.distributed group of the ep_size ranks when they are real processes

    def __post_init__(self):
        why = ep_split_problem(self.num_experts, self.ep_size)
        if why:
            raise ValueError(why)
        if not 0 <= self.rank < self.ep_size:
            raise ValueError(f"rank {self.rank} not in [0, {self.ep_size})")

    @classmethod
    def of(cls, p: Params, rank: int = 0, group: Any = None) -> "EPLayout":
        """The layout of point `p` as rank `rank` sees it."""
        return cls(rank, p.ep_size, p.num_experts, group)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def first_expert(self, rank: int) -> int:
        """The first (global) expert id rank `rank` owns."""
        return rank * self.experts_per_rank

    @property
    def expert_offset(self) -> int:
        return self.first_expert(self.rank)


@dataclass(frozen=True)
class Timing:
    mode: str = "auto"  # auto: cuda_graph on a GPU when the case allows, wall clock on CPU
    warmup: int = 10
    iters: int = 100
    unroll: int = 1  # cuda_graph: calls captured per replay; a sample is replay time / unroll
    max_seconds: float = 30.0  # stop sampling a point after this long (a CPU run of a big point)
    # A point still running after this long is killed and recorded failed (None: the device's default, see
    # moebench.run.point_worker.DEFAULT_POINT_TIMEOUT_S).
    point_timeout_s: float | None = None


@dataclass(frozen=True)
class Point:
    index: int
    impl: str
    params: Params

    @property
    def key(self) -> str:
        """Stable identity of a point (impl + all parameters), used to resume a run and to compare runs.
        Parameters added later are left out at their default, so runs recorded before them keep their keys."""
        params = {k: v for k, v in self.params.to_dict().items() if _LATER_DEFAULTS.get(k, _NO_DEFAULT) != v}
        blob = json.dumps({"impl": self.impl, **params}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


# Parameters added after reference runs were recorded, with their defaults (see Point.key).
_LATER_DEFAULTS = {"pcp_mask": "gathered", "dbo_mask": "sliced", "expert_dtype": "bf16", "model": None,
                   "config": None, "dp_size": 1, "sp_size": 1, "dbo": False, "trace_file": None,
                   "trace_replay": 0, "trace_real_points": 0, "ranks_per_node": 8, "wire_intra_gbps": None,
                   "wire_intra_latency_us": None, "wire_inter_gbps": None, "wire_inter_latency_us": None,
                   "dispatch_calibration": None, "wire_path": "dispatch.a2a",
                   "ep_rank_timings": None}
_NO_DEFAULT = object()
