"""Kernel families: how moebench benchmarks *any* function with a family's signature.

Each bench module registers, beside its own impls, one `KernelFamily` per kernel it benchmarks: `build_for(fn)`
returns the `build(p, ctx) -> Case` of an impl that calls `fn` exactly as moebench's own impl of that family is
called, on the inputs the family's built-in impls get, checked against the family's reference and declaring the
same bytes, routing and NVTX stage. Plugins (moebench.plugins.register_kernel), the torch.compile peers and the
library adapters all register through it, so an outside function gets the same case as moebench's own kernels.

`call` says in one line how `fn` is called and what it must return (docs/plugins.md lists them); it is also the
family's build signature: `signature_problem(family, fn)` reads from it the arguments `fn` is handed (names before
`=` by keyword, the others by position) and says which one `fn` lacks or requires beyond them, so a plugin with the
wrong signature is refused at registration instead of failing every point with a TypeError.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from moebench.params import Params
    from moebench.registry import Case, RunContext

__all__ = ["KernelFamily", "register_family", "get_family", "all_families", "set_path_registrar", "path_registrar",
           "call_arguments", "signature_problem"]


@dataclass(frozen=True)
class KernelFamily:
    name: str  # the kernel, e.g. "topk_softmax": impls are "<name>.<variant>"
    targets: tuple[str, ...]
    build_for: Callable[[Callable], Callable[["Params", "RunContext"], "Case"]]
    call: str  # how fn is called and what it returns
    validate: Callable[["Params"], str | None] | None = None  # the family's own limits (its Triton impl's)


_FAMILIES: dict[str, KernelFamily] = {}


def call_arguments(call: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (positional, keyword) argument names of a family's `call` line, `fn(a ..., b ..., c=..., d=...) -> ...`:
    the arguments are split at the commas outside brackets; each one's leading name, by keyword when `=` follows."""
    if not call.startswith("fn("):
        raise ValueError(f"call {call!r} does not start with 'fn('")
    depth, parts, current = 0, [], ""
    for ch in call[3:]:
        if depth == 0 and ch == ")":
            break
        if depth == 0 and ch == ",":
            parts.append(current)
            current = ""
            continue
        depth += (ch in "([{") - (ch in ")]}")
        current += ch
    else:
        raise ValueError(f"call {call!r}: no closing ')'")
    positional, keyword = [], []
    for part in [*parts, current]:
        m = re.match(r"\s*([A-Za-z_]\w*)\s*(=?)", part)
        if m is None:
            raise ValueError(f"call {call!r}: {part.strip()!r} does not start with an argument name")
        (keyword if m.group(2) else positional).append(m.group(1))
    return tuple(positional), tuple(keyword)


def signature_problem(family: KernelFamily, fn: Callable) -> str | None:
    """Why `fn` cannot be called as `family` calls it (one line naming the missing or extra argument), or None.
    A callable whose signature Python cannot read (a compiled extension's function) is not judged here."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional, keyword = call_arguments(family.call)
    kind = inspect.Parameter
    by_position = [q for q in params if q.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    var_positional = any(q.kind == kind.VAR_POSITIONAL for q in params)
    var_keyword = any(q.kind == kind.VAR_KEYWORD for q in params)
    handed = "fn(" + ", ".join([*positional, *(f"{k}=" for k in keyword)]) + ")"
    if len(positional) > len(by_position) and not var_positional:
        name = positional[len(by_position)]
        return (f"takes {len(by_position)} positional arguments, moebench passes {len(positional)}: missing an "
                f"argument for {name!r} (the family calls {handed})")
    bound = {q.name for q in by_position[:len(positional)]}
    by_name = {q.name: q for q in params if q.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)}
    for name in keyword:
        if (name not in by_name or name in bound) and not var_keyword:
            return f"has no argument {name + '='!r}, which moebench passes by keyword (the family calls {handed})"
        bound.add(name)
    for q in params:
        if q.name not in bound and q.default is kind.empty and q.kind not in (kind.VAR_POSITIONAL,
                                                                                kind.VAR_KEYWORD):
            return f"requires the extra argument {q.name!r}, which moebench never passes (the family calls {handed})"
    return None


def register_family(family: KernelFamily) -> KernelFamily:
    if family.name in _FAMILIES:
        raise ValueError(f"kernel family {family.name!r} registered twice")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> KernelFamily:
    from moebench import registry

    registry.load_all()  # the bench modules register the families
    if name not in _FAMILIES:
        raise ValueError(f"unknown kernel family {name!r} (one of {', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[name]


def all_families() -> dict[str, KernelFamily]:
    from moebench import registry

    registry.load_all()
    return dict(_FAMILIES)


# Dispatch paths are not a kernel family (one class per path, multi-rank); moebench.bench.dispatch hands its
# `register_path_impl` over here so that plugins can register a path without importing the bench package.
_path_registrar: list[Callable[[type], None]] = []


def set_path_registrar(fn: Callable[[type], None]) -> None:
    _path_registrar[:] = [fn]


def path_registrar() -> Callable[[type], None]:
    from moebench import registry

    registry.load_all()
    return _path_registrar[0]
