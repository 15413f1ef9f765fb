"""Launch configurations as data: each Triton kernel's candidate table, the tuned tables, and the one choice rule.

A tunable kernel registers a `Tunable` when its module is imported: its candidate table (name -> config object),
its shape bucket (the launch's shape dims -> a bucket key) and its fallback rule (shape dims -> (name, config),
the launch chosen before any tuning). No list names them: `tunable_kernels()` imports every module of
moebench.kernels and returns what registered. `choose(kernel, device, config, **dims)` picks one launch:

  1. explicit: `config` names a candidate (or is a config object the caller built);
  2. table:    the tuned table of this GPU (`tuned/<GPU name>.json` beside the kernels) has an entry for the
               kernel and the shape's bucket;
  3. rule:     otherwise the kernel's documented rule (the defaults measured before the tables existed).

The returned `Choice` says which (name, source, bucket, GPU), so a caller can record it; the launchers call the same
function, so what is recorded is what runs. A name a record carries is either a candidate (`config: <name>` launches
it again) or, for a rule's launch that is none of them (the interpreter's small tiles, a block narrower than every
candidate at a small H), "rule:<the rule's own label>" (RULE_PREFIX): no `config` names it, and check_config_name
refuses it saying so. A CPU (the Triton interpreter) is the GPU name "cpu": no table is
shipped for it, so the rule applies there unless a test points TABLES_DIR at one.

Buckets: each kernel's `bucket` function documents its key; the token (or route) count is rounded up to the next
power of two, every other dim must match exactly.

Table format (one JSON file per GPU name, written by `moebench tune`):
  {"format": 1, "gpu": "NVIDIA H200",
   "kernels": {"<kernel>": {"<bucket>": {"config": "<candidate>", "p50_us": {"<candidate>": us, ...},
                                         "points": n, "run": "<run directory>", "versions": {"triton": ...}}}}}
Only "config" is read here; the rest says where the choice came from.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from moebench.kernels._details.jit import interpreting, next_pow2

__all__ = ["Tunable", "Choice", "register_tunable", "tunable", "candidates", "choose", "lookup", "gpu_name",
           "table_path", "load_table", "clear_cache", "tables_digest", "check_config_name", "config_name_problem",
           "rule_name", "pow2_bucket", "tunable_kernels", "KERNELS_PACKAGE", "TABLES_DIR", "TABLE_FORMAT", "SOURCES", "RULE_PREFIX"]

TABLES_DIR = Path(__file__).resolve().parent.parent / "tuned"  # shipped with the package
TABLE_FORMAT = 1
SOURCES = ("explicit", "table", "rule")
AUTO = "auto"  # the same as no config: table, else rule
RULE_PREFIX = "rule:"  # a rule's launch that is no candidate is named RULE_PREFIX + its label (never a config)

KERNELS_PACKAGE = "moebench.kernels"  # every module of it is imported to find the tunables (tunable_kernels)


@dataclass(frozen=True)
class Tunable:
    kernel: str
    candidates: Mapping[str, Any]
    bucket: Callable[..., str]  # shape dims (keywords) -> bucket key
    # shape dims -> (name, config): the launch without a table entry; a name outside `candidates` is recorded as
    # RULE_PREFIX + name (rule_name)
    rule: Callable[..., tuple[str, Any]]
    rule_doc: str = ""


@dataclass(frozen=True)
class Choice:
    kernel: str
    name: str
    source: str  # explicit | table | rule
    bucket: str
    gpu: str
    config: Any
    note: str = ""  # why the launch differs from what the source named (e.g. a layout refit), else empty

    def record(self) -> dict[str, str]:
        """The fields every record of a point launching this kernel carries (config_note only when there is one)."""
        rec = {"config": self.name, "config_source": self.source, "config_bucket": self.bucket,
               "config_gpu": self.gpu}
        if self.note:
            rec["config_note"] = self.note
        return rec


_TUNABLES: dict[str, Tunable] = {}


def register_tunable(t: Tunable) -> Tunable:
    """Called by a kernel's module as it is imported (beside its launcher or in the config module it imports)."""
    _TUNABLES[t.kernel] = t
    return t


def tunable_kernels() -> tuple[str, ...]:
    """The tunable kernels' names, sorted: every non-underscore module of moebench.kernels is imported first (its
    launchers' modules register their Tunables as they are imported), so a new kernel needs no list."""
    pkg = importlib.import_module(KERNELS_PACKAGE)
    for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{KERNELS_PACKAGE}.{m.name}")
    return tuple(sorted(_TUNABLES))


def tunable(kernel: str) -> Tunable:
    if kernel not in _TUNABLES and kernel not in tunable_kernels():  # the kernel's module was not imported yet
        raise ValueError(f"{kernel!r} has no launch configs (tunable kernels: {', '.join(tunable_kernels())})")
    return _TUNABLES[kernel]


def candidates(kernel: str) -> Mapping[str, Any]:
    """The kernel's candidate table: name -> config."""
    return tunable(kernel).candidates


def pow2_bucket(n: int) -> int:
    """Token / route counts of a bucket: rounded up to the next power of two (0 and 1 -> 1)."""
    return next_pow2(max(1, int(n)))


def gpu_name(device: torch.device | str | None = None) -> str:
    """The name a tuned table is kept under: the CUDA device's name, "cpu" for the interpreter. None: the current
    CUDA device when there is one and the kernels are not interpreted."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() and not interpreting() else torch.device("cpu")
    if dev.type != "cuda":
        return "cpu"
    return _cuda_name(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_path(gpu: str, tables_dir: Path | str | None = None) -> Path:
    """tuned/<GPU name, non-alphanumerics as '_'>.json, e.g. tuned/NVIDIA_H200.json."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_") or "unknown"
    return Path(tables_dir if tables_dir is not None else TABLES_DIR) / f"{slug}.json"


def load_table(path: Path | str) -> dict:
    """A table file's content ({} when absent); a malformed one is a ValueError naming the file."""
    return dict(_load_table(str(path)))


@functools.lru_cache(maxsize=16)
def _load_table(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"tuned table {p}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT or not isinstance(data.get("kernels"), dict):
        raise ValueError(f"tuned table {p}: expected {{\"format\": {TABLE_FORMAT}, \"kernels\": {{...}}}}")
    return data


_CHOICES: dict[tuple, Choice] = {}  # (kernel, GPU, config name or None, shape dims) -> Choice


def clear_cache() -> None:
    """Forget loaded tables and the choices made from them (after `moebench tune` rewrote one, or a test moved
    TABLES_DIR)."""
    _load_table.cache_clear()
    _CHOICES.clear()


def lookup(kernel: str, gpu: str, bucket: str) -> str | None:
    """The tuned candidate name for (kernel, GPU name, bucket), or None when the table has no entry."""
    entry = ((_load_table(str(table_path(gpu))).get("kernels") or {}).get(kernel) or {}).get(bucket)
    if entry is None:
        return None
    name = entry.get("config") if isinstance(entry, dict) else None
    if name not in candidates(kernel):
        raise ValueError(f"tuned table {table_path(gpu)}: {kernel} {bucket}: {name!r} is not one of its "
                         f"candidates ({', '.join(candidates(kernel))})")
    return name


def tables_digest(tables_dir: Path | str | None = None) -> dict:
    """{"sha256": of every table file (name and bytes, in name order), "files": [names]}: the manifest records it,
    so that a resume under other tables is refused and a comparison can say the tables differ."""
    d = Path(tables_dir if tables_dir is not None else TABLES_DIR)
    files = sorted(p for p in d.glob("*.json") if p.is_file()) if d.is_dir() else []
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return {"sha256": h.hexdigest(), "files": [p.name for p in files]}


def rule_name(kernel: str, name: str) -> str:
    """The name a launch of the kernel's rule is recorded under: `name` when it is one of the kernel's candidates,
    else RULE_PREFIX + name (a launch of the rule's own, which no `config` can name)."""
    return name if name in candidates(kernel) else RULE_PREFIX + name


def config_name_problem(kernel: str, name: str) -> str | None:
    """Why `name` cannot be given as the kernel's config, or None: a candidate's name or "auto" can; a
    "rule:..." name (a rule's launch that is no candidate) and any other name cannot."""
    names = candidates(kernel)
    if name == AUTO or name in names:
        return None
    if name.startswith(RULE_PREFIX):
        return (f"{name!r} names a launch of {kernel}'s rule that is none of its candidates: no config selects it "
                "(leave config out, or auto, for the rule)")
    return f"{name!r} is not a {kernel} config (one of {', '.join(names)}, or auto)"


def check_config_name(kernel: str, name: str) -> None:
    """ValueError (one line, config_name_problem's) unless `name` is one of the kernel's candidates (or "auto")."""
    why = config_name_problem(kernel, name)
    if why:
        raise ValueError(f"config: {why}")


def choose(kernel: str, device: torch.device | str | None, config: Any = None, **dims) -> Choice:
    """The launch of `kernel` at these shape dims: explicit `config` (a candidate name, or a config object: its
    `name` attribute names it), else this GPU's tuned table, else the kernel's rule."""
    t = tunable(kernel)
    gpu = gpu_name(device)
    if config is not None and not isinstance(config, str):
        return Choice(kernel, getattr(config, "name", "") or "custom", "explicit", t.bucket(**dims), gpu, config)
    # launchers ask at every call: an eager timing loop should not pay the table path and lookup each time
    key = (kernel, gpu, config, tuple(dims.items()))
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _choose_named(t, kernel, gpu, config, dims)
    return choice


def _choose_named(t: Tunable, kernel: str, gpu: str, config: str | None, dims: dict) -> Choice:
    bucket = t.bucket(**dims)
    if config is not None and config != AUTO:
        check_config_name(kernel, config)
        return Choice(kernel, config, "explicit", bucket, gpu, t.candidates[config])
    name = lookup(kernel, gpu, bucket)
    if name is not None:
        return Choice(kernel, name, "table", bucket, gpu, t.candidates[name])
    name, cfg = t.rule(**dims)
    return Choice(kernel, rule_name(kernel, name), "rule", bucket, gpu, cfg)
