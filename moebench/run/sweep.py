"""Sweep files: YAML (safe_load only) -> typed, validated, frozen dataclasses -> the list of points.

The data a point is made of (Params, Timing, Point) lives in moebench.params, below everything; this module loads
and validates sweeps, which needs the registry (impl names and their limits), the plugins, the presets and the
headline specs, so it sits above all of them and nothing below the runner imports it. Every problem is one
`SweepError` line naming the file, the key (and the `--set` that gave it) and the reason, before anything runs or
is written. Limits that keep hostile input cheap: the strict YAML rules of `strict_yaml` (no aliases, no duplicate
keys, bounded depth and size, UTF-8), finite numbers only, names of NAME_PATTERN, and the point count (the product
of the axis lengths times the impls) at most `max_points` (DEFAULT_MAX_POINTS), computed before any point is built.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from moebench import registry
from moebench.params import Params, Point, Timing, ep_split_problem, registered_knobs
from moebench.plugins import PluginError, load_plugins
from moebench.presets import UnknownModel, apply_preset, get_preset
from moebench.report.headline import spec_problem
from moebench.run import strict_yaml
from moebench.run.paths import SweepPathError, plugin_entry, resolve_param_paths
from moebench.traces.capture_lists import capture_list_problem


class SweepError(ValueError):
    """A sweep that cannot run. str() is the one line shown to the user."""


# The values a parameter accepts (its type is the Params field's), and the combinations that are impossible.

# The core's choices; a knob group declares its own (its CHOICES, moebench.params.register_knobs).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("bf16", "fp16", "fp32"),
    "padding_fill": ("zeros", "repeat", "stale", "random"),
    "padding_producer": ("ratio", "cudagraph", "dp", "sp", "pcp", "dbo"),
    "routing": ("uniform", "zipf", "hot_expert"),
    "scoring": ("softmax", "sigmoid"),
    "scale_format": ("ue8m0_packed", "fp32"),
    "ep_mode": ("real", "simulated"),
    "pcp_mask": ("gathered", "local"),
    "dbo_mask": ("sliced", "full", "none"),
    "expert_dtype": ("bf16", "fp8"),
}

CORE_NAMES = tuple(f.name for f in fields(Params) if f.name != "groups")


def knob_groups() -> tuple[type, ...]:
    """Every family's knob group (moebench.params.register_knobs): each registers itself as its module is imported,
    and importing every bench module (registry.load_all) imports every family's."""
    registry.load_all()
    return registered_knobs()


def param_names() -> tuple[str, ...]:
    """Every key a sweep may put under `fixed` or `axes`: the core's, then each knob group's."""
    return CORE_NAMES + tuple(f.name for g in knob_groups() for f in fields(g))


@functools.lru_cache(maxsize=8)
def _declared(groups: tuple[type, ...]) -> tuple[dict[str, Any], dict[str, tuple], dict[str, tuple]]:
    """(type, choices, path) of every key, the core's then each knob group's (its CHOICES and PATHS: a key naming a
    file or a directory -> (the folder of the files bundled with moebench or None, whether it is a directory)). The
    loader resolves a path key (moebench.run.paths.resolve_sweep_path) and the sweep holds the absolute path."""
    types = {k: v for k, v in get_type_hints(Params).items() if k in CORE_NAMES}
    choices: dict[str, tuple] = dict(CHOICES)
    paths: dict[str, tuple] = {}
    for group in groups:
        types.update(get_type_hints(group))
        choices.update(getattr(group, "CHOICES", {}))
        paths.update(getattr(group, "PATHS", {}))
    return types, choices, paths


def _check_type(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if origin is Union:
        return any(_check_type(value, a) for a in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is list or origin is list:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if get_origin(hint) is Union:
        return " or ".join(_type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if hint is list:
        return "list of int"
    return getattr(hint, "__name__", str(hint))


def check_param_value(key: str, value: Any) -> str | None:
    """Why `value` is not acceptable for parameter `key` on its own, or None."""
    types, choices, _ = _declared(knob_groups())
    hint = types[key]
    if not _check_type(value, hint):
        return f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}"
    choices = choices.get(key)
    if choices is not None and value not in choices:
        return f"{value!r} is not one of {', '.join(choices)}"
    return None


def params_problem(p: Params) -> str | None:
    """Why a combination of parameters is impossible, or None: the core's checks here, then each knob group's own
    (its problem(p)). Impl-specific limits live in Impl.validate."""
    positive = ("num_tokens", "num_experts", "top_k", "hidden", "intermediate", "group_size", "block_size",
                "ep_size", "num_expert_group", "topk_group", "producer_size", "hot_experts")
    for k in positive:
        if getattr(p, k) < 1:
            return f"{k}: must be >= 1, got {getattr(p, k)}"
    if not 0.0 <= p.padding_ratio < 1.0:
        return f"padding_ratio: must be in [0, 1), got {p.padding_ratio}"
    if p.top_k > p.num_experts:
        return f"top_k: {p.top_k} > num_experts {p.num_experts}"
    if p.num_experts % p.num_expert_group:
        return f"num_expert_group: {p.num_expert_group} does not divide num_experts {p.num_experts}"
    if p.topk_group > p.num_expert_group:
        return f"topk_group: {p.topk_group} > num_expert_group {p.num_expert_group}"
    if p.num_expert_group > 1 and p.top_k > p.topk_group * (p.num_experts // p.num_expert_group):
        return f"top_k: {p.top_k} > experts in the {p.topk_group} kept groups"
    why = ep_split_problem(p.num_experts, p.ep_size)
    if why:
        return why
    if p.num_local_experts is not None and not 1 <= p.num_local_experts <= p.num_experts:
        return f"num_local_experts: must be in [1, num_experts={p.num_experts}], got {p.num_local_experts}"
    if p.hot_experts > p.num_experts:
        return f"hot_experts: {p.hot_experts} > num_experts {p.num_experts}"
    if not 0.0 <= p.hot_ratio <= 1.0:
        return f"hot_ratio: must be in [0, 1], got {p.hot_ratio}"
    if p.zipf_exponent < 0:
        return f"zipf_exponent: must be >= 0, got {p.zipf_exponent}"
    why = capture_list_problem(p.capture_sizes)
    if why:
        return f"capture_sizes: {why}"
    # pcp_mask / dbo_mask (moebench.inputs.router_mask) only mean something with their producer
    if p.pcp_mask != "gathered" and p.padding_producer != "pcp":
        return f"pcp_mask: {p.pcp_mask!r} needs padding_producer pcp, got {p.padding_producer!r}"
    if p.dbo_mask != "sliced" and p.padding_producer != "dbo":
        return f"dbo_mask: {p.dbo_mask!r} needs padding_producer dbo, got {p.padding_producer!r}"
    for group in knob_groups():
        why = group.problem(p.knobs(group), p) if hasattr(group, "problem") else None
        if why:
            return why
    return None


# Timing and the sweep itself

TIMING_MODES = ("auto", "events", "cuda_graph", "wall")
DEFAULT_MAX_POINTS = 100_000
CPU_SIZE = "cpu"  # the size the README tells CPU users to add: every bundled sweep takes it
# A sweep name becomes a directory name: a newline, a slash or 300 characters must not get that far.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Sweep:
    name: str
    target: str
    impls: tuple[str, ...]
    fixed: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)
    description: str = ""
    source: str = "<memory>"
    headlines: tuple = ()  # moebench.report.headline specs (dicts), checked by _check_headlines
    plugins: tuple = ()  # modules imported before the impls are looked up (moebench.plugins)
    sizes: dict = field(default_factory=dict)  # name -> {override key: value}, applied by load_sweep(size=)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "impls": list(self.impls), "fixed": self.fixed,
                "axes": self.axes, "timing": dataclasses.asdict(self.timing), "description": self.description,
                "headlines": [dict(h) for h in self.headlines], "plugins": list(self.plugins), "sizes": self.sizes}


_SWEEP_KEYS = {"name": str, "target": str, "impls": list, "fixed": dict, "axes": dict, "timing": dict,
               "description": str, "headlines": list, "plugins": list, "sizes": dict}
_TIMING_TYPES = {"mode": str, "warmup": int, "iters": int, "unroll": int, "max_seconds": float,
                 "point_timeout_s": float}
_TIMING_NULLABLE = {"point_timeout_s"}


def _fail(src: str, key: str, reason: str) -> SweepError:
    return SweepError(f"{src}: {key}: {reason}")


def parse_set(expr: str) -> tuple[list[str], Any]:
    """`--set axes.top_k=[4,8]` -> (["axes", "top_k"], [4, 8]). The value is YAML-parsed, never evaluated."""
    if "=" not in expr:
        raise SweepError(f"--set {expr}: expected key=value")
    key, raw = expr.split("=", 1)
    path = [k for k in key.strip().split(".") if k]
    if not path:
        raise SweepError(f"--set {expr}: empty key")
    if not raw.strip():  # `--set trace_file=$T` with T unset would silently mean "none": make the user say so
        raise SweepError(f"--set {expr}: no value for {'.'.join(path)} (write {'.'.join(path)}=null to unset it)")
    try:
        value = strict_yaml.loads(raw)
    except strict_yaml.YAMLRefused as e:
        raise SweepError(f"--set {expr}: {e}") from None
    except yaml.YAMLError as e:
        raise SweepError(f"--set {expr}: value is not valid YAML ({str(e).splitlines()[0]})") from None
    return path, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`raw` with each `--set KEY=VALUE` applied in order."""
    return _apply_paths(raw, [(*parse_set(expr), f"--set {expr}") for expr in overrides])


def _apply_paths(raw: dict, changes: list[tuple[list[str], Any, str]]) -> dict:
    """`raw` with each (key path, value, how the user wrote it) applied, as `--set` applies it."""
    raw = copy.deepcopy(raw)  # keeps shared nodes shared (safe_load data may share them; ours has no aliases)
    for path, value, expr in changes:
        node = raw
        for k in path[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise SweepError(f"{expr}: {k} is not a mapping")
            node = node.setdefault(k, {})
        # A parameter set at top level (--set top_k=4) goes to `fixed` and drops the axis of the same name.
        if len(path) == 1 and path[0] in param_names():
            raw.setdefault("fixed", {})[path[0]] = value
            if isinstance(raw.get("axes"), dict):
                raw["axes"].pop(path[0], None)
            continue
        if len(path) == 2 and path[0] == "axes" and isinstance(raw.get("fixed"), dict):
            raw["fixed"].pop(path[1], None)
        if len(path) == 2 and path[0] == "fixed" and isinstance(raw.get("axes"), dict):
            raw["axes"].pop(path[1], None)
        node[path[-1]] = value
    return raw


def load_sweep(path: str | Path, overrides: list[str] | None = None, *,
               max_points: int | None = DEFAULT_MAX_POINTS, size: str | None = None) -> Sweep:
    """The sweep file at `path`; `size` names one of its `sizes:` (applied first), then each --set override."""
    src = str(path)
    try:
        raw = strict_yaml.loads(strict_yaml.read_text(path))
    except strict_yaml.YAMLRefused as e:
        raise SweepError(f"{src}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "file"
        raise SweepError(f"{src}: {where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{src}: top level: expected a mapping, got {type(raw).__name__}")
    file_raw = raw
    raw = apply_overrides(_apply_paths(raw, _named_size(raw, src, size)) if size is not None else raw, overrides or [])
    try:
        sweep = sweep_from_dict(raw, src, max_points=max_points)
    except SweepError as e:  # name the --set that gave the refused key (a top-level parameter is its fixed.<key>)
        named = [x for x in overrides or [] if re.search(rf": (fixed\.)?{re.escape(x.split('=')[0])}[: ]", f"{e} ")]
        raise SweepError(f"{e} (from --set {named[-1]})" if named else str(e)) from None
    _check_sizes(file_raw, src, max_points)  # after the sweep itself: its own problems are named first
    return sweep


def size_overrides(path: str | Path, size: str) -> list[str]:
    """The size `size` of the sweep file at `path` as `--set KEY=VALUE` expressions (for a process that is handed
    the sweep's path and overrides, as `moebench profile` hands them to the process nsys runs)."""
    raw = strict_yaml.loads(strict_yaml.read_text(path))
    return [f"{'.'.join(p)}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for p, v, _ in _named_size(raw if isinstance(raw, dict) else {}, str(path), size)]


def _named_size(raw: dict, src: str, size: str) -> list[tuple[list[str], Any, str]]:
    """The changes `--size size` makes to `raw`: `cpu` of a file with no sizes runs it as written (every bundled
    sweep slow on a CPU declares `cpu`), any other missing size is refused."""
    if size == CPU_SIZE and "sizes" not in raw:
        return []
    sizes = raw.get("sizes") if isinstance(raw.get("sizes"), dict) else {}
    if size not in sizes:
        known = ", ".join(map(str, sizes)) if sizes else "it declares none"
        raise SweepError(f"--size {size}: {src} has no size {size!r} (sizes: {known})")
    return _size_changes(src, size, sizes[size])


def _size_changes(src: str, name: Any, overrides: Any) -> list[tuple[list[str], Any, str]]:
    """The (key path, value, label) changes of the size `name` (its mapping of --set keys to values)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise _fail(src, "sizes", f"{name!r} is not a size name (letters, digits, '_', '.' or '-')")
    if not isinstance(overrides, dict) or not overrides:
        raise _fail(src, f"sizes.{name}", "expected a non-empty mapping of override keys to values")
    changes = []
    for key, value in overrides.items():
        path = [k for k in str(key).split(".") if k]
        if not isinstance(key, str) or not path or path[0] == "sizes":
            raise _fail(src, f"sizes.{name}", f"{key!r} is not an override key (as for --set)")
        changes.append((path, value, f"{src}: sizes.{name}.{key}"))
    return changes


def _check_sizes(raw: dict, src: str, max_points: int | None) -> None:
    """Each size applied to the sweep file must give a valid sweep (checked like the file itself)."""
    sizes = raw.get("sizes")
    if not isinstance(sizes, dict):
        return  # not a mapping, or absent: sweep_from_dict says so
    base = {k: v for k, v in raw.items() if k != "sizes"}
    for name, overrides in sizes.items():
        try:
            sweep_from_dict(_apply_paths(base, _size_changes(src, name, overrides)), src, max_points=max_points)
        except SweepError as e:
            raise SweepError(f"{e} (with sizes.{name})") from None


def sweep_from_dict(raw: dict, src: str = "<memory>", *, max_points: int | None = DEFAULT_MAX_POINTS) -> Sweep:
    """Validate plain data (a parsed sweep file) into a Sweep; `max_points` None: no limit on the point count."""
    bad = strict_yaml.tree_problem(raw)
    if bad:
        raise _fail(src, *bad)
    for k, v in raw.items():
        if k not in _SWEEP_KEYS:
            raise _fail(src, k, f"unknown key (allowed: {', '.join(_SWEEP_KEYS)})")
        if not isinstance(v, _SWEEP_KEYS[k]):
            raise _fail(src, k, f"expected {_SWEEP_KEYS[k].__name__}, got {type(v).__name__}")
    for k in ("name", "target", "impls"):
        if k not in raw:
            raise _fail(src, k, "missing")
    name, target = raw["name"], raw["target"]
    if not NAME_PATTERN.fullmatch(name):
        shown = repr(name) if len(name) <= 40 else repr(name[:40]) + f"... ({len(name)} characters)"
        raise _fail(src, "name", f"{shown} must be 1-64 letters, digits, '_', '.' or '-', starting with a letter "
                                 "or digit (it names the run directory)")
    if target not in registry.TARGETS:
        raise _fail(src, "target", f"{target!r} is not one of {', '.join(registry.TARGETS)}")
    impls = raw["impls"]
    if not impls:
        raise _fail(src, "impls", "empty list")
    sweep_dir = None if not src or src.startswith("<") else Path(src).parent  # None: a sweep that is no file
    try:
        plugins = [plugin_entry(m, i, sweep_dir) for i, m in enumerate(raw.get("plugins") or [])]
    except SweepPathError as e:
        raise _fail(src, e.key, str(e)) from None
    try:
        load_plugins(plugins, src)  # before the impl names are looked up
    except PluginError as e:
        raise SweepError(str(e)) from None
    known = registry.all_impls()
    for i, name_i in enumerate(impls):
        if not isinstance(name_i, str):
            raise _fail(src, f"impls[{i}]", f"expected str, got {type(name_i).__name__}")
        if name_i not in known:
            near = sorted(n for n in known if n.split(".")[0] == name_i.split(".")[0])
            hint = f" (known for this kernel: {', '.join(near)})" if near else " (see `moebench list`)"
            raise _fail(src, f"impls[{i}]", f"unknown impl {name_i!r}{hint}")
        if target not in known[name_i].targets:
            raise _fail(src, f"impls[{i}]", f"{name_i} cannot run under target {target!r} "
                                            f"(its targets: {', '.join(known[name_i].targets)})")
    if len(set(impls)) != len(impls):
        raise _fail(src, "impls", "listed twice")

    fixed = raw.get("fixed") or {}
    axes = raw.get("axes") or {}
    names = param_names()
    for section, table in (("fixed", fixed), ("axes", axes)):
        for k, v in table.items():
            if k not in names:
                raise _fail(src, f"{section}.{k}", "unknown parameter (see docs/sweeps.md)")
            values = v if section == "axes" else [v]
            if section == "axes":
                if not isinstance(v, list):
                    raise _fail(src, f"axes.{k}", f"expected a list of values, got {type(v).__name__}")
                if not v:
                    raise _fail(src, f"axes.{k}", "empty axis")
            for val in values:
                why = check_param_value(k, val) or (_model_problem(val) if k == "model" else None)
                if why:
                    raise _fail(src, f"{section}.{k}", why)
    try:
        fixed, axes = resolve_param_paths(fixed, axes, sweep_dir, _declared(knob_groups())[2])
    except SweepPathError as e:
        raise _fail(src, e.key, str(e)) from None
    both = set(fixed) & set(axes)
    if both:
        k = sorted(both)[0]
        raise _fail(src, f"axes.{k}", "also given under fixed")
    num_points = math.prod(len(v) for v in axes.values()) * len(impls)
    if max_points is not None and num_points > max_points:
        sizes = " x ".join([str(len(v)) for v in axes.values()] + [f"{len(impls)} impls"])
        raise _fail(src, "axes", f"{sizes} = {num_points:,} points, over the limit of {max_points:,} "
                                 "(raise it with --max-points)")

    t = raw.get("timing") or {}
    for k, v in t.items():
        if k not in _TIMING_TYPES:
            raise _fail(src, f"timing.{k}", f"unknown key (allowed: {', '.join(_TIMING_TYPES)})")
        want = _TIMING_TYPES[k]
        if v is None and k in _TIMING_NULLABLE:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if want is float else \
            isinstance(v, want) and not isinstance(v, bool)
        if not ok:
            raise _fail(src, f"timing.{k}", f"expected {want.__name__}, got {type(v).__name__} {v!r}")
    timing = Timing(**t)
    if timing.mode not in TIMING_MODES:
        raise _fail(src, "timing.mode", f"{timing.mode!r} is not one of {', '.join(TIMING_MODES)}")
    why = timing.problem()  # its key named (timing.iters): load_sweep names the --set that gave it from the key
    if why:
        raise _fail(src, f"timing.{why[0]}", why[1])

    headlines = _check_headlines(raw.get("headlines") or [], src, impls)
    sizes = raw.get("sizes") or {}
    for size_name, overrides in sizes.items():
        _size_changes(src, size_name, overrides)
    sweep = Sweep(name=name, target=target, impls=tuple(impls), fixed=dict(fixed), axes=dict(axes), timing=timing,
                  description=raw.get("description", ""), source=src, headlines=headlines,
                  plugins=tuple(plugins), sizes=sizes)
    expand(sweep)  # validates every combination
    return sweep


def _model_problem(name) -> str | None:
    if name is None:
        return None
    try:
        get_preset(name)
    except UnknownModel as e:
        return str(e)
    return None


def _check_headlines(specs: list, src: str, impls: list) -> tuple:
    """The `headlines:` list (moebench.report.headline documents a spec): one line naming the bad entry and key."""
    for i, spec in enumerate(specs):
        why = spec_problem(spec, param_names(), impls)
        if why:
            raise _fail(src, f"headlines[{i}]", why)
    return tuple(dict(s) for s in specs)


def config_problem(impl_name: str, config: str | None) -> str | None:
    """Why `config` cannot select a launch of impl_name's tuned kernel, or None (None and "auto" always can)."""
    if config is None or config == "auto":
        return None
    kernel = registry.get(impl_name).tuned_kernel
    if kernel is None:
        return f"config: {config!r} given, but {impl_name} has no launch configs (only a tuned kernel's impls do)"
    from moebench.kernels.runtime import config_name_problem

    why = config_name_problem(kernel, config)
    return f"config: {why}" if why else None


def expand(sweep: Sweep) -> list[Point]:
    """Cartesian product of the axes (in file order), times the impls (innermost). Validates each point."""
    keys = list(sweep.axes)
    points: list[Point] = []
    for combo in itertools.product(*(sweep.axes[k] for k in keys)):
        values = dict(sweep.fixed)
        values.update(zip(keys, combo))
        if values.get("model") is not None:  # the preset fills what the sweep does not set itself
            values = apply_preset(values, explicit=(set(sweep.fixed) | set(keys)) - {"model"})
        try:
            params = Params(**values)
        except TypeError as e:  # pragma: no cover - keys were checked above
            raise _fail(sweep.source, "fixed", str(e)) from None
        why = params_problem(params)
        if why:
            key, _, reason = why.partition(": ")
            where = f"axes.{key}" if key in sweep.axes else f"fixed.{key}" if key in sweep.fixed else key
            combo_s = ", ".join(f"{k}={v}" for k, v in zip(keys, combo))
            raise _fail(sweep.source, where, f"{reason}" + (f" (at {combo_s})" if combo_s else ""))
        for impl_name in sweep.impls:
            why = config_problem(impl_name, params.config) or registry.get(impl_name).validate(params)
            if why:
                combo_s = ", ".join(f"{k}={v}" for k, v in zip(keys, combo))
                raise _fail(sweep.source, impl_name, f"{why}" + (f" (at {combo_s})" if combo_s else ""))
            points.append(Point(len(points), impl_name, params))
    return points
