"""The parameters of one point: `Params` (the core keys, and the knob groups families declare beside themselves
with `register_knobs`), `Timing` (how a point is timed) and `Point` (one impl at one Params, with the stable key runs
are resumed and compared by); and the values derived from Params that several layers need, each computed in one
place: `EPLayout` (which EP rank owns which experts), `padding_rows` (how many rows a padding ratio pads).

Plain frozen data, importing nothing of moebench, so that everything else can sit above it: the inputs, the
registry, the dispatch paths, the bench modules and the measurements read a point's parameters from here, while
loading and validating a sweep file (which needs the registry, the plugins and the presets) is moebench.run.sweep's job.
The values each core key accepts are checked there (moebench.run.sweep.CHOICES, params_problem); a knob group's
beside its family (its problem(), CHOICES and PATHS, which the loader calls and reads for every registered group).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

# ---------------------------------------------------------------------------------------------------------------
# Parameters of one point. Every key a sweep may put under `fixed` or `axes` is a core field here or a key of a
# registered knob group; anything else is an unknown key. Defaults are a DeepSeek-V3-like layer.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, init=False)
class Params:
    """The core of a point (tokens, padding, routing, shapes, EP layout, bookkeeping) and the knob groups of the
    families that declare their own (`register_knobs`), read through `p.knobs(Group)`.

    Built from flat keys, as a sweep writes them: `Params(num_tokens=8, trace_steps=5)` gives each key to the core or
    to the registered group that declares it (a group's module registers it at import; moebench.run.sweep's loader
    imports them all). `to_dict()` is the flat view again (the record's `params`), with every registered group's
    keys. A group at its defaults is not stored, so two Params of the same values are equal."""

    # token axis and padding
    num_tokens: int = 1024  # rows on one rank, padding included (for `cudagraph`: real tokens before padding)
    padding_ratio: float = 0.0  # fraction of rows that are padding (`ratio` producer: the trailing rows)
    padding_producer: str = "ratio"
    padding_fill: str = "repeat"
    mask: bool = True  # pass is_padding to mask-aware impls (False: padded rows routed like real ones)
    # cudagraph producer: a list, a name of moebench.traces.capture_lists, or None = 1,2,4,8 then multiples of 8
    # up to 512
    capture_sizes: Optional[Union[list, str]] = None
    producer_size: int = 2  # ranks of the dp / sp (TP size) / pcp producer: its dp_size or sp_size
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
    # expert parallelism
    num_local_experts: Optional[int] = None  # experts one rank computes; None: num_experts / ep_size (local_experts)
    ep_size: int = 1
    ep_mode: str = "real"  # real: one process per EP rank; simulated: the ranks computed in one (bench.ep_sim)
    # bookkeeping
    seed: int = 0
    repeat: int = 0  # a label: lets one sweep time the same point several times
    # model preset (moebench.presets): fills the layer's shape keys the sweep does not set itself; recorded
    model: Optional[str] = None
    # launch config of the impl's tuned kernel (a name from its candidate table, kernels._details.tuning); None or
    # "auto": the GPU's tuned table, else the kernel's rule. Part of the point key: `moebench tune` sweeps it.
    config: Optional[str] = None
    # the knob groups not at their defaults, in _KNOB_GROUPS' order (set through the flat keys, read by knobs())
    groups: tuple = ()

    def __init__(self, **values: Any):
        given = {type(g): g for g in values.pop("groups", ())}
        changes: dict[type, dict[str, Any]] = {}
        for name in list(values):
            if name not in _CORE_NAMES:
                if name not in _KNOB_OWNER:
                    raise TypeError(f"Params: unknown parameter {name!r} (a family's key is known once its module "
                                    "is imported: moebench.run.sweep.knob_groups())")
                changes.setdefault(_KNOB_OWNER[name], {})[name] = values.pop(name)
        for f in dataclasses.fields(self):
            if f.name != "groups":
                object.__setattr__(self, f.name, values[f.name] if f.name in values else f.default)
        for group, group_changes in changes.items():
            given[group] = dataclasses.replace(given.get(group) or group(), **group_changes)
        kept = tuple(given[g] for g in _KNOB_GROUPS if g in given and given[g] != g())
        object.__setattr__(self, "groups", kept)

    def knobs(self, group: type[G]) -> G:
        """This point's values of the knob group `group` (its defaults when none was set)."""
        for g in self.groups:
            if type(g) is group:
                return g
        return group()

    @property
    def num_padding(self) -> int:
        return padding_rows(self.num_tokens, self.padding_ratio)

    @property
    def local_experts(self) -> int:
        """The experts one EP rank computes: num_local_experts when set, else its share (EPLayout.local_experts)."""
        return self.num_local_experts if self.num_local_experts is not None else EPLayout.of(self).local_experts

    def to_dict(self) -> dict[str, Any]:
        """The flat view: every core key, then every registered group's keys (the record's `params`)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "groups"}
        for group in _KNOB_GROUPS:
            out.update(dataclasses.asdict(self.knobs(group)))
        return out


G = TypeVar("G")
_CORE_NAMES = frozenset(f.name for f in dataclasses.fields(Params)) - {"groups"}
_KNOB_GROUPS: list[type] = []  # ordered by module and name
_KNOB_OWNER: dict[str, type] = {}  # a group's key -> its group


def register_knobs(group: type[G]) -> type[G]:
    """Class decorator: `group` (a frozen dataclass whose fields all have defaults) declares a family's keys, beside
    the family. Its keys become sweep keys and Params keys; a key is in a point's key only away from its default,
    unless the group lists it in KEYED_AT_DEFAULT (keys that were keyed before the groups existed), so a new group
    leaves every recorded key as it was. A group may define `problem(self, p) -> str | None` (why its values are
    impossible at point p, "key: reason"), CHOICES (key -> the values it accepts) and PATHS (key -> (the folder of
    the bundled files or None, whether it names a directory)): moebench.run.sweep's loader calls and reads them."""
    if group in _KNOB_GROUPS:
        return group
    names = [f.name for f in dataclasses.fields(group)]
    for name in names:
        owner = "Params" if name in _CORE_NAMES else getattr(_KNOB_OWNER.get(name), "__name__", None)
        if owner:
            raise ValueError(f"{group.__name__}: key {name!r} is already {owner}'s")
    _KNOB_GROUPS.append(group)
    _KNOB_GROUPS.sort(key=lambda g: (g.__module__, g.__qualname__))  # the flat view's order, whatever imports first
    _KNOB_OWNER.update(dict.fromkeys(names, group))
    return group


def registered_knobs() -> tuple[type, ...]:
    """The knob groups registered so far (ordered by module and name)."""
    return tuple(_KNOB_GROUPS)


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
    [r * E / ep_size, (r + 1) * E / ep_size). The one place the experts one rank owns (local_experts) are derived;
    the dispatch paths, the imbalance figures and the simulated ranks all read it from here."""

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
    def local_experts(self) -> int:
        """The experts each EP rank owns: num_experts / ep_size."""
        return self.num_experts // self.ep_size

    def first_expert(self, rank: int) -> int:
        """The first (global) expert id rank `rank` owns."""
        return rank * self.local_experts

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

    # (least, upper bound) of each number; a duration must be above its least. The upper bounds because every sample
    # is stored and CUDA events are allocated per iteration up front.
    RANGES = {"warmup": (0, 100_000), "iters": (1, 100_000), "unroll": (1, 1024), "max_seconds": (0, 86_400.0),
              "point_timeout_s": (0, 86_400.0)}
    DURATIONS = ("max_seconds", "point_timeout_s")

    def problem(self) -> tuple[str, str] | None:
        """(the key, why) of the first number out of its range, or None: a key, so that a refusal names it."""
        for k, (least, limit) in self.RANGES.items():
            v = getattr(self, k)
            if v is None:  # point_timeout_s: the device's default
                continue
            if v < least or (k in self.DURATIONS and v == least):
                default = " (null: the device default)" if k == "point_timeout_s" else ""
                return k, f"{v} is not {'>' if k in self.DURATIONS else '>='} {least}{default}"
            if v > limit:
                return k, f"{v} is over the limit of {limit:g}"
        return None


@dataclass(frozen=True)
class Point:
    index: int
    impl: str
    params: Params

    @property
    def key(self) -> str:
        """Stable identity of a point (impl + all parameters), used to resume a run and to compare runs.
        Parameters added later are left out at their default, so runs recorded before them keep their keys: the core
        ones listed in _LATER_DEFAULTS, and every knob group's keys but those it lists in KEYED_AT_DEFAULT."""
        params = {k: v for k, v in self.params.to_dict().items() if _key_default(k) != v}
        blob = json.dumps({"impl": self.impl, **params}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _key_default(name: str) -> Any:
    """The value at which parameter `name` is left out of a point's key (_NO_DEFAULT: never left out)."""
    group = _KNOB_OWNER.get(name)
    if group is None:
        return _LATER_DEFAULTS.get(name, _NO_DEFAULT)
    if name in getattr(group, "KEYED_AT_DEFAULT", ()):
        return _NO_DEFAULT
    return next(f.default for f in dataclasses.fields(group) if f.name == name)


# Core parameters added after reference runs were recorded, with their defaults (see Point.key).
_LATER_DEFAULTS = {"pcp_mask": "gathered", "dbo_mask": "sliced", "expert_dtype": "bf16", "model": None,
                   "config": None}
_NO_DEFAULT = object()
