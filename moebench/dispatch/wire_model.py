"""The EP wire model: how long an expert-parallel step's dispatch and combine take, from the bytes each EP rank sends
to each other rank. A MODEL, named as one in every record (`WireModel.record()`, `"kind": "model"`), with figures
measured by moebench on 2 x H200 (NVLink), a public figure for the link between nodes, and `calibrate()` to fit it
to a user's own dispatch run. Plain Python: nothing here needs torch or a process group.

One phase (a dispatch or a combine) is a collective: every EP rank waits for every other. For rank r, on node
r // ranks_per_node, the off-rank bytes it sends and receives split into those to / from ranks of its own node
(intra: NVLink) and of other nodes (inter: the NIC); its own rows never touch a wire (the diagonal is ignored).

    t_link(r)  = latency + max(out, in) / bandwidth     when out + in > 0 on that link, else 0
    t(r)       = max(t_intra(r), t_inter(r))            (NVLink and the NIC carry in parallel)
    phase_us   = overhead + max over r of t(r)          (dispatch_overhead_us or combine_overhead_us)

The overheads are the dispatch path's fixed cost per phase beyond the link: its plan, count exchange and host sync.

Not modelled: congestion (a rank's link bandwidth is its own whatever the others do), DeepEP's forwarding of
inter-node traffic through NVLink (one RDMA copy per destination node, not per destination rank), and any
overlap of the wire with compute. The defaults' NVLink figures come from 2 GPUs of one node: no wire beyond that
was measured.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from moebench.records import MANIFEST, RECORDS, load_manifest, load_records

DEFAULT_PATH = "dispatch.a2a"
# The committed 2 x H200 dispatch run the intra-node defaults are calibrated on (tests/dispatch/test_wire_model.py checks
# that calibrate() on it gives DEFAULT_WIRE_MODEL's figures, rounded as below).
DEFAULT_CALIBRATION_RUN = "results/h200/dispatch_ref-20261130T062359Z"
DEFAULT_RANKS_PER_NODE = 8  # an HGX H200 node
MIN_FIT_POINTS = 3
RECORDING_RANK = 0  # the rank whose record a multi-rank point stores (moebench.run.multirank)


class WireCalibrationError(ValueError):
    """A run the wire model cannot be calibrated from. str() is one line: the file, then the reason."""


@dataclass(frozen=True)
class LinkModel:
    """One kind of link as one EP rank sees it: `bandwidth_gbps` in GB/s (1e9 bytes/s) of the off-rank bytes that
    leave (or enter) the rank over it, and `latency_us` paid once per phase when the rank uses it."""

    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self):
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"bandwidth_gbps: must be > 0, got {self.bandwidth_gbps}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"latency_us: must be >= 0, got {self.latency_us}")

    def time_us(self, out_bytes: float, in_bytes: float) -> float:
        if out_bytes + in_bytes <= 0:
            return 0.0
        return self.latency_us + max(out_bytes, in_bytes) / (self.bandwidth_gbps * 1e3)  # 1 GB/s = 1e3 bytes/us

    def times_us(self, out_bytes: np.ndarray, in_bytes: np.ndarray) -> np.ndarray:
        """time_us of every rank at once."""
        t = self.latency_us + np.maximum(out_bytes, in_bytes) / (self.bandwidth_gbps * 1e3)
        return np.where(out_bytes + in_bytes > 0, t, 0.0)


@dataclass(frozen=True)
class PhaseTime:
    """One phase under a wire model: `rank_us[r]` = t(r) (the link time, overhead excluded), the slowest rank,
    the off-rank bytes summed over every sender that cross NVLink (`intra_bytes`) and the NIC (`inter_bytes`),
    and `us` = overhead_us + rank_us[slowest_rank]."""

    rank_us: tuple[float, ...]
    slowest_rank: int
    intra_bytes: float
    inter_bytes: float
    overhead_us: float
    us: float


@dataclass(frozen=True)
class WireModel:
    """The wire of an EP deployment (see the module docstring for the formula). `source` names, per figure (keys
    `intra.bandwidth_gbps`, `intra.latency_us`, `inter.bandwidth_gbps`, `inter.latency_us`, `ranks_per_node`,
    `dispatch_overhead_us`, `combine_overhead_us`), where it came from."""

    name: str
    intra: LinkModel
    inter: LinkModel
    ranks_per_node: int
    dispatch_overhead_us: float
    combine_overhead_us: float
    source: dict = field(default_factory=dict)
    # the card the figures were measured on ("" where unknown) and the run, in words
    gpu: str = ""
    measured_on: str = ""

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node: must be >= 1, got {self.ranks_per_node}")
        for k in ("dispatch_overhead_us", "combine_overhead_us"):
            if not (getattr(self, k) >= 0 and math.isfinite(getattr(self, k))):
                raise ValueError(f"{k}: must be >= 0, got {getattr(self, k)}")

    def record(self) -> dict[str, Any]:
        """JSON-able: the model named as a model, every figure and its source."""
        return {"kind": "model", "name": self.name,
                "formula": "phase_us = overhead + max_r max(t_intra(r), t_inter(r)), t_link = latency + "
                           "max(out, in) / bandwidth over the rank's off-rank bytes on that link (0 without any)",
                "intra": dataclasses.asdict(self.intra), "inter": dataclasses.asdict(self.inter),
                "ranks_per_node": self.ranks_per_node, "dispatch_overhead_us": self.dispatch_overhead_us,
                "combine_overhead_us": self.combine_overhead_us, "source": dict(self.source),
                "gpu": self.gpu, "measured_on": self.measured_on}

    def phase_us(self, bytes_matrix: Sequence[Sequence[float]], overhead_us: float = 0.0) -> PhaseTime:
        """One phase: `bytes_matrix[src][dst]` = bytes EP rank src sends to EP rank dst (a square list of lists,
        or anything with .tolist(): a numpy array, a tensor); the diagonal (a rank's own rows) is ignored.
        Computed over the whole matrix at once (a step of EP 64 is 4096 entries a phase)."""
        b = _square(bytes_matrix)
        n = b.shape[0]
        if n == 0:
            return PhaseTime((), 0, 0.0, 0.0, overhead_us, overhead_us)
        node = np.arange(n) // self.ranks_per_node
        same = node[:, None] == node[None, :]
        np.fill_diagonal(b, 0.0)
        intra_out, inter_out = (b * same).sum(axis=1), (b * ~same).sum(axis=1)
        intra_in, inter_in = (b * same).sum(axis=0), (b * ~same).sum(axis=0)
        rank_us = np.maximum(self.intra.times_us(intra_out, intra_in), self.inter.times_us(inter_out, inter_in))
        slowest = int(np.argmax(rank_us))
        return PhaseTime(tuple(rank_us.tolist()), slowest, float(intra_out.sum()), float(inter_out.sum()),
                         overhead_us, overhead_us + float(rank_us[slowest]))

    def dispatch_us(self, bytes_matrix: Sequence[Sequence[float]]) -> PhaseTime:
        return self.phase_us(bytes_matrix, self.dispatch_overhead_us)

    def combine_us(self, bytes_matrix: Sequence[Sequence[float]]) -> PhaseTime:
        return self.phase_us(bytes_matrix, self.combine_overhead_us)


def _square(matrix: Any) -> np.ndarray:
    rows = matrix.tolist() if hasattr(matrix, "tolist") else matrix
    for i, row in enumerate(rows):
        if len(row) != len(rows):
            raise ValueError(f"bytes_matrix: row {i} has {len(row)} entries, expected {len(rows)} (square)")
    b = np.array(rows, dtype=np.float64)
    if b.size == 0:
        return b.reshape(0, 0)
    if b.ndim != 2 or b.shape[0] != b.shape[1]:
        raise ValueError(f"bytes_matrix: expected a square matrix, got shape {b.shape}")
    bad = ~(np.isfinite(b) & (b >= 0))
    if bad.any():
        raise ValueError(f"bytes_matrix: row {int(np.argwhere(bad)[0][0])} holds a negative or non-finite byte count")
    return b


# ---------------------------------------------------------------------------------------------------------------
# Payload sizes (bytes per row that crosses a wire)
# ---------------------------------------------------------------------------------------------------------------

FP8_SCALE_BLOCK = 128  # columns per fp32 scale in fp8 dispatch


def dispatch_row_bytes(hidden: int, top_k: int, payload_dtype: str = "bf16") -> int:
    """One dispatched row: the hidden state plus, per top-k slot, an int32 expert id and an fp32 weight (what
    moebench's dispatch paths count as payload: 14400 bytes at H=7168, top-8, bf16).
    bf16: hidden * 2. fp8: hidden * 1 + one fp32 scale per 128 columns, ceil(hidden / 128) * 4, as DeepEP's fp8
    dispatch sends it (DeepEP v1.2.1: tests/utils.py per_token_cast_to_fp8 makes scales [tokens, hidden / 128];
    tests/test_intranode.py counts fp8 bytes as (1 + 4 / 128) / 2 of bf16's)."""
    if payload_dtype == "bf16":
        x = hidden * 2
    elif payload_dtype == "fp8":
        x = hidden + math.ceil(hidden / FP8_SCALE_BLOCK) * 4
    else:
        raise ValueError(f"payload_dtype: {payload_dtype!r} is not one of bf16, fp8")
    return x + top_k * (4 + 4)


def combine_row_bytes(hidden: int) -> int:
    """One combined row: the expert output in bf16, back to the rank that owns the token."""
    return hidden * 2


# ---------------------------------------------------------------------------------------------------------------
# The defaults
# ---------------------------------------------------------------------------------------------------------------

_DEFAULT_SOURCE = f"default: {DEFAULT_CALIBRATION_RUN} (2 x H200, NVLink, path a2a), calibrate() rounded"
# Between nodes, one 400 Gb/s ConnectX-7 InfiniBand NDR NIC per GPU (an HGX H200 node's usual fabric, ~50 GB/s
# line rate). Bandwidth: what DeepEP measured over it, DeepEP v1.2.1 README, "Performance", "Normal kernels with
# NVLink and RDMA forwarding" (H800, CX7 InfiniBand 400 Gb/s): internode EP 16 (two nodes of 8), dispatch and
# combine bottleneck bandwidth 43 GB/s (RDMA). Latency: NCCL's own model of one network hop, NCCL v2.28.9 (the
# NCCL torch ships on the H200 machines) src/graph/tuning.cc, hwLatencies[NET][Ring][Simple] = 14 us.
INTER_NODE_DEFAULT = LinkModel(bandwidth_gbps=43.0, latency_us=14.0)
_INTER_SOURCE = {
    "inter.bandwidth_gbps": "public: DeepEP v1.2.1 README, Performance, normal kernels, internode EP 16 bottleneck "
                            "bandwidth 43 GB/s (RDMA) on H800 with CX7 InfiniBand 400 Gb/s (~50 GB/s line rate)",
    "inter.latency_us": "public: NCCL v2.28.9 src/graph/tuning.cc, hwLatencies[NET][Ring][Simple] = 14 us",
}

DEFAULT_WIRE_MODEL = WireModel(
    name="h200-nvlink-a2a+ib-ndr",
    intra=LinkModel(bandwidth_gbps=379.0, latency_us=0.0),
    inter=INTER_NODE_DEFAULT,
    ranks_per_node=DEFAULT_RANKS_PER_NODE,
    dispatch_overhead_us=224.0,
    combine_overhead_us=175.0,
    source={"intra.bandwidth_gbps": _DEFAULT_SOURCE,
            "intra.latency_us": _DEFAULT_SOURCE + ": not separable from the path overhead on one node (in the "
                                                  "overheads)",
            **_INTER_SOURCE,
            "ranks_per_node": "default: an HGX H200 node (8 GPUs)",
            "dispatch_overhead_us": _DEFAULT_SOURCE, "combine_overhead_us": _DEFAULT_SOURCE},
    gpu="NVIDIA H200",
    measured_on=f"2 x NVIDIA H200, dispatch run {DEFAULT_CALIBRATION_RUN}",
)


# ---------------------------------------------------------------------------------------------------------------
# Calibration from a dispatch run
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Observation:
    phase: str  # "dispatch" | "combine"
    off_rank_bytes: float  # max(out, in) of the recording rank's off-rank bytes
    us: float  # the phase's p50 (per-iteration max over ranks)


def _point_observations(rec: dict) -> list[_Observation] | None:
    """The record's two observations, or None when it lacks a figure the fit needs. The record is the recording
    rank's: its traffic stands for every rank's (exact on 2 ranks, where rank 1 sends what rank 0 receives and
    back)."""
    info, stages = rec.get("info"), rec.get("stages")
    try:
        sent, recv_rows, own = info["rows_sent_per_dest"], int(info["recv_rows"]), int(info["recv_rows_own"])
        sent_off = sum(int(v) for d, v in enumerate(sent) if d != RECORDING_RANK)
        recv_off = recv_rows - own
        dispatch_row = info["dispatch_payload_bytes"] / recv_rows if recv_rows else 0.0
        combine_row = info["combine_payload_bytes"] / sum(sent) if sum(sent) else 0.0
        d_us, c_us = float(stages["dispatch"]["p50"]), float(stages["combine"]["p50"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(d_us) and math.isfinite(c_us)):
        return None
    # dispatch: out = rows sent off-rank, in = rows received off-rank; combine carries them back the other way
    return [_Observation("dispatch", max(sent_off, recv_off) * dispatch_row, d_us),
            _Observation("combine", max(sent_off, recv_off) * combine_row, c_us)]


def _fit(obs: list[_Observation]) -> tuple[dict[str, float], float, float]:
    """Least squares of us = c[phase] + s * bytes with one slope s for both phases and c[phase] >= 0: the
    unconstrained fit, or with a negative intercept held at 0 (every such subset tried, the best feasible kept).
    Returns (intercepts, slope in us per byte, rms residual in us)."""
    phases = sorted({o.phase for o in obs})
    if any(len({o.off_rank_bytes for o in obs if o.phase == p}) < 2 for p in phases):
        raise ValueError("no byte count differs between the points")
    best = None
    for held in range(1 << len(phases)):
        zero = {p for i, p in enumerate(phases) if held >> i & 1}
        num = den = 0.0
        means = {}
        for p in phases:
            xs = [o.off_rank_bytes for o in obs if o.phase == p]
            ts = [o.us for o in obs if o.phase == p]
            mx, mt = (0.0, 0.0) if p in zero else (sum(xs) / len(xs), sum(ts) / len(ts))
            means[p] = (mx, mt)
            num += sum((x - mx) * (t - mt) for x, t in zip(xs, ts))
            den += sum((x - mx) ** 2 for x in xs)
        if den <= 0:
            continue
        slope = num / den
        c = {p: 0.0 if p in zero else means[p][1] - slope * means[p][0] for p in phases}
        if any(v < 0 for v in c.values()):
            continue
        sse = sum((o.us - c[o.phase] - slope * o.off_rank_bytes) ** 2 for o in obs)
        if best is None or sse < best[2]:
            best = (c, slope, sse)
    c, slope, sse = best
    return c, slope, math.sqrt(sse / len(obs))


def calibrate(run_dir: str | Path, path: str = DEFAULT_PATH) -> WireModel:
    """Fit the intra-node link and the path overheads of `path` (an impl name, `dispatch.a2a`) to a run of
    `moebench run sweeps/dispatch.yaml` (manifest.json + records.jsonl).

    Each ok point of `path` whose EP group fits on the run's host (ep_size >= 2 and <= its GPUs) gives two
    observations, its dispatch and combine p50 (`stages`, per-iteration max over ranks) against the off-rank
    payload bytes of the recording rank, max(sent, received) (`info`: rows sent per destination, rows received,
    the own rows, payload bytes per row; combine: the same rows back at hidden * 2 bytes). They are fitted by least
    squares to us = overhead[phase] + bytes / bandwidth: one bandwidth, an intercept per phase (>= 0).
    What the fit cannot separate: within one node the link latency and the path's overhead are one intercept, so
    the intercepts are the overheads and the intra latency is 0; the path's own wire overhead (a2a's row metadata,
    a2a_fixed's capacity blocks) is folded into the bandwidth, since the bytes are payload bytes (what phase_us is
    given); on more than 2 ranks, rank 0's traffic stands for every rank's. The link between nodes keeps its
    public default (a run on one host has no such link), and ranks_per_node is the host's GPU count.

    Refused with WireCalibrationError (one line: the file, the reason): a directory that is not a run, a run whose
    target is not dispatch or that ran on no GPU, fewer than MIN_FIT_POINTS usable points of `path` or no spread
    of bytes among them, and a fit whose bandwidth is not positive."""
    run = Path(run_dir)
    if not run.is_dir():
        raise WireCalibrationError(f"{run}: no such run directory")
    if not (run / MANIFEST).is_file():
        raise WireCalibrationError(f"{run}: not a moebench run (no {MANIFEST})")
    try:
        manifest = load_manifest(run)
    except (OSError, ValueError) as e:
        raise WireCalibrationError(f"{run / MANIFEST}: not readable as JSON ({e})".splitlines()[0]) from None
    sweep = manifest.get("sweep") if isinstance(manifest, dict) else None
    target = sweep.get("target") if isinstance(sweep, dict) else None
    if target != "dispatch":
        raise WireCalibrationError(f"{run / MANIFEST}: target {target!r} is not dispatch (calibrate from a run of "
                                   "sweeps/dispatch.yaml)")
    env = manifest.get("env") if isinstance(manifest.get("env"), dict) else {}
    gpus = env.get("gpu_count")
    if manifest.get("device") != "cuda" or not isinstance(gpus, int) or gpus < 2:
        raise WireCalibrationError(f"{run / MANIFEST}: not a run on 2 or more GPUs of one host (device "
                                   f"{manifest.get('device')!r}, gpu_count {gpus!r}): its times are no GPU link's")
    where = run / RECORDS
    try:
        ok = [r for r in load_records(run) if isinstance(r, dict) and r.get("status") == "ok"]
    except (OSError, ValueError) as e:
        raise WireCalibrationError(f"{where}: not readable ({e})".splitlines()[0]) from None
    obs: list[_Observation] = []
    points = 0
    for rec in (r for r in ok if r.get("impl") == path):
        ep = rec.get("params", {}).get("ep_size") if isinstance(rec.get("params"), dict) else None
        if not isinstance(ep, int) or not 2 <= ep <= gpus:
            continue
        got = _point_observations(rec)
        if got:
            obs.extend(got)
            points += 1
    if points < MIN_FIT_POINTS:
        held = sorted({str(r.get("impl")) for r in ok if r.get("impl")})
        raise WireCalibrationError(f"{where}: {points} usable ok points of {path} (ep_size 2..{gpus}), the fit needs "
                                   f"{MIN_FIT_POINTS} (ok points of: {', '.join(held) or 'none'})")
    try:
        intercepts, slope, rms = _fit(obs)
    except ValueError as e:
        raise WireCalibrationError(f"{where}: {path}: {e}") from None
    if slope <= 0:
        raise WireCalibrationError(f"{where}: {path}: the fit gives no positive bandwidth (more bytes are not "
                                   "slower over these points)")
    said = f"calibrated: {run}, {points} points, {path}"
    return WireModel(
        name=f"calibrated:{run.name}:{path}",
        intra=LinkModel(bandwidth_gbps=1e-3 / slope, latency_us=0.0),
        inter=INTER_NODE_DEFAULT,
        ranks_per_node=gpus,
        dispatch_overhead_us=intercepts.get("dispatch", 0.0),
        combine_overhead_us=intercepts.get("combine", 0.0),
        source={"intra.bandwidth_gbps": said,
                "intra.latency_us": f"{said}: not separable from the path overhead on one node (in the overheads)",
                **{k: f"{v} (the calibration run has no link between nodes)" for k, v in _INTER_SOURCE.items()},
                "ranks_per_node": f"calibrated: {run / MANIFEST} (GPUs on its host)",
                "dispatch_overhead_us": said, "combine_overhead_us": said,
                "fit": f"rms residual {rms:.1f} us over {len(obs)} phase times"},
        gpu=str(env.get("gpu") or ""),
        measured_on=f"{gpus} x {env.get('gpu') or 'GPU'}, dispatch run {run}",
    )


@functools.lru_cache(maxsize=16)
def _calibrate_cached(run_dir: str, path: str, stamp: tuple) -> WireModel:
    return calibrate(run_dir, path)


def _calibration(run_dir: str, path: str) -> WireModel:
    """calibrate(), read once per state of the run's files (a sweep validates it at every point)."""
    run = Path(run_dir)
    stamp = tuple(f.stat().st_mtime_ns if f.is_file() else None for f in (run / MANIFEST, run / RECORDS))
    return _calibrate_cached(str(run.resolve()) if run.exists() else str(run), path, stamp)


def calibration_problem(run_dir: str, path: str = DEFAULT_PATH) -> str | None:
    """Why `run_dir` cannot calibrate the wire for `path` (calibrate()'s one line), or None."""
    try:
        _calibration(run_dir, path)
    except WireCalibrationError as e:
        return str(e)
    return None


# Sweep keys over the model's figures: (key, figure, source key).
_SWEEP_KEYS = (("wire_intra_gbps", "intra", "bandwidth_gbps"), ("wire_intra_latency_us", "intra", "latency_us"),
               ("wire_inter_gbps", "inter", "bandwidth_gbps"), ("wire_inter_latency_us", "inter", "latency_us"))


def wire_settings_problem(ranks_per_node: int, figures: dict[str, Optional[float]], ep_size: int,
                          dispatch_calibration: Optional[str], wire_path: str) -> str | None:
    """Why these settings cannot make a model (a bandwidth <= 0, a latency < 0, ranks_per_node not dividing
    ep_size, wire_path without a calibration, a calibration calibrate() refuses), or None. `figures`: the
    _SWEEP_KEYS' values (None: the model's own)."""
    if ranks_per_node < 1:
        return f"ranks_per_node: must be >= 1, got {ranks_per_node}"
    for k in ("wire_intra_gbps", "wire_inter_gbps"):
        if figures.get(k) is not None and not figures[k] > 0:
            return f"{k}: must be > 0 GB/s, got {figures[k]}"
    for k in ("wire_intra_latency_us", "wire_inter_latency_us"):
        if figures.get(k) is not None and not figures[k] >= 0:
            return f"{k}: must be >= 0 us, got {figures[k]}"
    if ep_size > ranks_per_node and ep_size % ranks_per_node:
        return (f"ranks_per_node: {ranks_per_node} does not divide ep_size {ep_size} (the EP ranks fill "
                "whole nodes; set ranks_per_node to the deployment's GPUs per node)")
    if dispatch_calibration is None:
        if wire_path != DEFAULT_PATH:
            return f"wire_path: {wire_path!r} needs dispatch_calibration (the defaults model {DEFAULT_PATH})"
        return None
    why = calibration_problem(dispatch_calibration, wire_path)
    return f"dispatch_calibration: {why}" if why else None


def configured_wire_model(ranks_per_node: int, figures: dict[str, Optional[float]],
                          dispatch_calibration: Optional[str], wire_path: str) -> WireModel:
    """The wire model of a deployment: DEFAULT_WIRE_MODEL, replaced by calibrate(dispatch_calibration, wire_path)
    when a calibration run is set (a wire_path other than the default needs one), then each figure of `figures`
    that is set (the _SWEEP_KEYS: wire_intra_gbps, wire_intra_latency_us, wire_inter_gbps,
    wire_inter_latency_us). ranks_per_node is always the caller's (the modelled deployment's; a calibration run's
    own host only decides which of its points ran within one node)."""
    if dispatch_calibration is not None:
        model = _calibration(dispatch_calibration, wire_path)
    elif wire_path != DEFAULT_PATH:
        raise ValueError(f"wire_path: {wire_path!r} needs dispatch_calibration (the defaults model "
                         f"{DEFAULT_PATH})")
    else:
        model = DEFAULT_WIRE_MODEL
    source = dict(model.source)
    links = {"intra": model.intra, "inter": model.inter}
    for key, link, figure in _SWEEP_KEYS:
        value = figures.get(key)
        if value is not None:
            links[link] = dataclasses.replace(links[link], **{figure: float(value)})
            source[f"{link}.{figure}"] = f"sweep key {key}"
    if ranks_per_node != DEFAULT_RANKS_PER_NODE:
        source["ranks_per_node"] = "sweep key ranks_per_node"
    else:
        source["ranks_per_node"] = DEFAULT_WIRE_MODEL.source["ranks_per_node"]
    return dataclasses.replace(model, intra=links["intra"], inter=links["inter"], ranks_per_node=ranks_per_node,
                               source=source)
