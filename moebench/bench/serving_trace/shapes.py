"""One padded shape of a serving trace, measured once: the layer of moebench.bench.layer timed masked and
oblivious on a seeded batch of `rows` rows whose first `real` are real tokens, and the figures its routing gives.

A shape is (rows, real): the layer's work depends on both (the masked layer computes the real rows' routes, the
oblivious one every row's, and repeat-filled padding piles onto the experts the copied row picks). A shape's batch
is the prefix of two seeded streams (shape_streams: the real tokens, then the padding p.padding_fill makes), the
same for both sides, so its real rows are those of the real-only shape (real, real). The expert weights are the
cached ones (inputs.cached_expert_weights: built once for the run's layer shape); each side's LayerPipeline is built
once per shape, timed (measure.timing.measure_settled on a GPU, measure with the sweep's timing under the
interpreter) and freed. The figures (`shape_figures`: prefix sums of the streams' routing, no batch, no pipeline)
and the timings (`time_shape`) are separate: serving_trace reads the figures of every shape but times a set.
The shape store (`ShapeStore`, `measure_shapes`): the streams, and shapes already routed or timed by the point
before, in the same run and at the same layer parameters (a what-if axis over capture lists shares most of them), are reused; the store is
the run's (RunContext.run_store), so nothing outlives the run; a point at other layer parameters starts it afresh.
Figures from the reference routing of the batch, per side (padding routed when oblivious, -1 when masked):
  padding_gemm_rows   expert-GEMM rows computed for padded rows: their routes to this rank's local experts
  rank_loads          routes to each of the ep_size EP ranks' experts (the step sums them over the calls that
                      dispatch together: its slowest rank's excess over the mean rank)
  max_rows_per_rank   the most rows any EP rank receives (what a fixed-capacity dispatch sizes its blocks by)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from moebench.bench.layer import LayerPipeline, check_pipeline
from moebench.check import CheckResult
from moebench.inputs import cached_expert_weights
from moebench.measure.imbalance import per_rank_loads
from moebench.measure.timing import measure, measure_settled
from moebench.bench.serving_trace.knobs import TRACE_KEYS
from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.shape_streams import ShapeStreams, stream_size
from moebench.params import EPLayout, Params, Timing

MIN_SPREAD_SAMPLES = 5  # fewer samples give no p10-p90 spread worth the name


@dataclass
class ShapeFigures:
    """What one shape costs, per side (dicts keyed by SIDES); a dict left empty was not measured (layer_us: not
    timed, the routing figures: not routed)."""

    rows: int
    real: int
    layer_us: dict[str, float]
    padding_gemm_rows: dict[str, int]
    rank_loads: dict[str, list[int]]
    max_rows_per_rank: dict[str, int]
    # half the p10-p90 spread of each side's samples (None: too few samples to tell)
    layer_spread_us: dict[str, float | None] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "real": self.real, "layer_us": {k: round(v, 3) for k, v in self.layer_us.items()},
                "layer_spread_us": {k: None if v is None else round(v, 3) for k, v in self.layer_spread_us.items()},
                "padding_gemm_rows": self.padding_gemm_rows, "rank_loads": self.rank_loads,
                "max_rows_per_rank": self.max_rows_per_rank}


def _weights(p: Params, device: torch.device):
    if p.expert_dtype == "fp8":
        return None, None  # the pipeline's fp8 experts quantise (once per weight key) and hold the weights
    return cached_expert_weights(p.local_experts, p.hidden, p.intermediate, p.seed, device)


def routing_figures(p: Params, batch, ids: torch.Tensor) -> tuple[int, list[int], int]:
    """(padding_gemm_rows, rank_loads, max_rows_per_rank) of one side's routing `ids` [T, K]."""
    ids = ids.to(torch.int64)
    local = (ids >= 0) & (ids < p.local_experts)
    gemm_rows = int(local[batch.is_padding].sum().item())
    loads = per_rank_loads(ids, p.num_experts, p.ep_size).tolist()
    if p.ep_size == 1:
        return gemm_rows, loads, int((ids >= 0).any(dim=1).sum().item())
    epr = EPLayout.of(p).local_experts
    dest = torch.where(ids >= 0, ids // epr, torch.full_like(ids, -1))
    in_rank = torch.stack([(dest == r).any(dim=1) for r in range(p.ep_size)], dim=1)
    return gemm_rows, loads, int(in_rank.sum(dim=0).max().item())


class ShapeBench:
    """Builds, times and measures shapes of one layer point (the sweep's layer parameters)."""

    def __init__(self, p: Params, device: torch.device, timing: Timing, streams: ShapeStreams | None = None):
        self.p, self.device, self.timing = p, device, timing
        self.streams = streams
        self.w13, self.w2 = _weights(p, device)
        self.last_spread_us: float | None = None
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # the shapes' graphs share it
        self.last_spreads_us: dict[str, float | None] = {}

    def batch(self, rows: int, real: int):
        """The shape's batch: the streams' real prefix and pad prefix (shape_streams), so a padded call (rows, real)
        and its real tokens alone (real, real) differ only by the padding. Without streams (a shape on its own)
        they are made for this shape."""
        return self._streams_for(rows, real).batch(rows, real)

    def _streams_for(self, rows: int, real: int) -> ShapeStreams:
        if self.streams is None or real > self.streams.max_real or rows - real > self.streams.max_pad:
            self.streams = ShapeStreams(self.p, self.device, real, rows - real)
        return self.streams

    def pipeline(self, sp: Params, batch, side: str) -> LayerPipeline:
        return LayerPipeline(sp, batch, self.w13, self.w2, masked=side == "masked", mask=batch.is_padding)

    def time_side(self, sp: Params, batch, side: str) -> float:
        """p50 microseconds of one side's layer on this batch (its pipeline built here and freed); the samples'
        half p10-p90 spread is left in `last_spread_us` (None under MIN_SPREAD_SAMPLES samples). On a GPU timed by
        measure_settled (samples until they settle, at most timing.iters), under the interpreter by measure()."""
        pipe = self.pipeline(sp, batch, side)
        try:
            if self.device.type == "cuda":
                got = measure_settled(pipe.run, self.device, self.timing.iters, pool=self.pool)
                self.last_spread_us = got.spread * got.us if got.samples >= MIN_SPREAD_SAMPLES else None
                return got.us
            stats = measure(pipe.run, self.timing, self.device, graph_capturable=True).stats
        finally:
            del pipe
        self.last_spread_us = (float(stats["p90"] - stats["p10"]) / 2 if stats["n"] >= MIN_SPREAD_SAMPLES
                               else None)
        return float(stats["p50"])

    def shape_figures_many(self, shapes: Sequence[tuple[int, int]]) -> dict[str, dict[str, np.ndarray]]:
        """The routing's figures of many shapes as arrays (ShapeStreams.figures_many)."""
        rows = np.asarray([s[0] for s in shapes], dtype=np.int64)
        real = np.asarray([s[1] for s in shapes], dtype=np.int64)
        need_real, need_pad = (int(real.max()), int((rows - real).max())) if len(shapes) else (1, 1)
        self._streams_for(need_real + need_pad, need_real)  # streams that hold the most real and padded rows
        return self.streams.figures_many(rows, real)

    def shape_figures(self, rows: int, real: int) -> ShapeFigures:
        """The routing's figures of one shape (layer_us left empty), read off the streams' prefix sums."""
        gemm, loads, most = self._streams_for(rows, real).figures(rows, real)
        return ShapeFigures(rows, real, {}, gemm, loads, most)

    def time_shape(self, rows: int, real: int) -> dict[str, float]:
        """Both sides' p50 microseconds at one shape (the same seeded batch as its figures); their spreads are
        left in `last_spreads_us`."""
        sp, batch = self.batch(rows, real)
        out, self.last_spreads_us = {}, {}
        for side in SIDES:
            out[side] = self.time_side(sp, batch, side)
            self.last_spreads_us[side] = self.last_spread_us
        return out

    def measure_shape(self, rows: int, real: int) -> ShapeFigures:
        """Figures and timings of one shape."""
        f = self.shape_figures(rows, real)
        f.layer_us = self.time_shape(rows, real)
        f.layer_spread_us = dict(self.last_spreads_us)
        return f

    def check_shape(self, rows: int, real: int) -> CheckResult:
        """Both sides' pipelines at one shape against the plain-torch references, stage by stage."""
        sp, batch = self.batch(rows, real)
        results = []
        for side in SIDES:
            res = check_pipeline(self.pipeline(sp, batch, side), bitwise_staging=self.device.type == "cuda",
                                 seed=sp.seed)
            if not res.ok:
                res = CheckResult(False, f"{side} layer at ({rows} rows, {real} real): {res.detail}", res.metrics)
            results.append(res)
        return CheckResult.merge(*results)


class ShapeStore:
    """One run's measured shapes, of one layer point at a time: {(rows, real): ShapeFigures} (exact shapes and grid
    points share entries), kept while the points of the run share their layer parameters (`layer_key`)."""

    RUN_STORE_KEY = "serving_trace.shapes"

    def __init__(self):
        self.layer_key: tuple | None = None
        self.shapes: dict[tuple[int, int], ShapeFigures] = {}
        self.streams: ShapeStreams | None = None

    @classmethod
    def of_run(cls, run_store: dict) -> "ShapeStore":
        """The run's store (made on the run's first serving_trace point)."""
        return run_store.setdefault(cls.RUN_STORE_KEY, cls())

    def for_layer(self, layer_key: tuple) -> dict[tuple[int, int], ShapeFigures]:
        """The shapes of the layer point `layer_key`; another layer point's are dropped first."""
        if self.layer_key != layer_key:
            self.shapes, self.layer_key, self.streams = {}, layer_key, None
        return self.shapes

    def streams_for(self, p: Params, device: torch.device, max_real: int, max_pad: int) -> ShapeStreams:
        """The layer point's streams, at least max_real / max_pad rows, in powers of two and the padding's at least
        the real tokens' (a call's padding rarely passes its real tokens' capture size): the points of a what-if
        axis share them. New streams drop the shapes measured on the old ones."""
        self.for_layer(layer_key(p, device))
        max_pad = max(max_pad, max_real)
        got = self.streams
        if got is None or got.max_real < max_real or got.max_pad < max_pad:
            self.streams = ShapeStreams(p, device, stream_size(max(max_real, got.max_real if got else 1)),
                                        stream_size(max(max_pad, got.max_pad if got else 1)))
            self.shapes = {}
        return self.streams


def layer_key(p: Params, device: torch.device) -> tuple:
    """What a shape's figures depend on: the device and every parameter but TRACE_KEYS."""
    return (str(device), tuple(sorted((k, repr(v)) for k, v in p.to_dict().items() if k not in TRACE_KEYS)))


class ShapeFigureTable(Mapping):
    """The figures of many shapes: their routing figures as arrays (ShapeStreams.figures_many, one row a shape) and
    the timed ones' layer times (the store's entries); `table[shape]` is that shape's ShapeFigures, made when asked
    (a long trace has 10^5 shapes: the per-step arithmetic reads the arrays, `column`)."""

    def __init__(self, shapes: list[tuple[int, int]], arrays: dict[str, dict[str, np.ndarray]],
                 timed: dict[tuple[int, int], ShapeFigures]):
        self.shapes, self.arrays, self.timed = shapes, arrays, timed
        self.index = {s: i for i, s in enumerate(shapes)}

    def __getitem__(self, shape: tuple[int, int]) -> ShapeFigures:
        i = self.index[shape]
        entry = self.timed.get(shape)
        a = self.arrays
        return ShapeFigures(shape[0], shape[1], dict(entry.layer_us) if entry else {},
                            {side: int(a[side]["padding_gemm_rows"][i]) for side in SIDES},
                            {side: a[side]["rank_loads"][i].tolist() for side in SIDES},
                            {side: int(a[side]["max_rows_per_rank"][i]) for side in SIDES},
                            dict(entry.layer_spread_us) if entry else {})

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, shape) -> bool:
        return shape in self.index

    def spread_us(self, shape: tuple[int, int]) -> dict[str, float | None]:
        """A timed shape's half p10-p90 spreads ({} for a shape not timed)."""
        entry = self.timed.get(shape)
        return dict(entry.layer_spread_us) if entry else {}

    def positions(self, shapes: Sequence[tuple[int, int]]) -> np.ndarray:
        """The rows of the arrays that hold `shapes`, in that order (for column)."""
        return np.asarray([self.index[s] for s in shapes], dtype=np.int64)

    def column(self, what: str, side: str, positions: np.ndarray) -> np.ndarray:
        """A routing figure of the shapes at `positions` (positions())."""
        return self.arrays[side][what][positions]


def measure_shapes(p: Params, bench: ShapeBench, routed: list[tuple[int, int]], timed: list[tuple[int, int]],
                   store: ShapeStore, progress=None, clock=None
                   ) -> tuple[ShapeFigureTable, dict, int]:
    """The routing figures of every `routed` shape (a ShapeFigureTable, with the layer times of those timed), the
    timing table {(side, rows, real): us} of every `timed` one (reusing what `store` holds at this layer point),
    and the count of shapes timed now. `clock` (record.PhaseClock) gets the phases `routing` and `shapes`."""
    shapes = store.for_layer(layer_key(p, bench.device))
    phase = clock.phase if clock is not None else (lambda name: contextlib.nullcontext())

    def entry(shape: tuple[int, int]) -> ShapeFigures:
        if shape not in shapes:
            shapes[shape] = ShapeFigures(shape[0], shape[1], {}, {}, {}, {})
        return shapes[shape]

    with phase("routing"):
        routed = list(routed)
        arrays = bench.shape_figures_many(routed)
    timed_now = 0
    with phase("shapes"):
        for i, shape in enumerate(timed):
            got = entry(shape)
            if progress is not None:
                progress(i, len(timed), "trace shapes timed", f"rows {shape[0]}, real {shape[1]}")
            if not got.layer_us:
                got.layer_us = bench.time_shape(*shape)
                got.layer_spread_us = dict(bench.last_spreads_us)
                timed_now += 1
    table = {(side, *shape): shapes[shape].layer_us[side] for shape in timed for side in SIDES}
    return ShapeFigureTable(routed, arrays, shapes), table, timed_now
