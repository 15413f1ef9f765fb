"""Kernel families: how moebench benchmarks *any* function with a family's signature.

Each bench module registers, beside its own impls, one `KernelFamily` per kernel it benchmarks: `build_for(fn)`
returns the `build(p, ctx) -> Case` of an impl that calls `fn` exactly as moebench's own impl of that family is
called, on the inputs the family's built-in impls get, checked against the family's reference and declaring the
same bytes, routing and NVTX stage. Plugins (moebench.plugins.register_kernel), the torch.compile peers and the
library adapters all register through it, so an outside function gets the same case as moebench's own kernels.

`call` says in one line how `fn` is called and what it must return (docs/plugins.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from moebench.params import Params
    from moebench.registry import Case, RunContext

__all__ = ["KernelFamily", "register_family", "get_family", "all_families", "set_path_registrar", "path_registrar"]


@dataclass(frozen=True)
class KernelFamily:
    name: str  # the kernel, e.g. "topk_softmax": impls are "<name>.<variant>"
    targets: tuple[str, ...]
    build_for: Callable[[Callable], Callable[["Params", "RunContext"], "Case"]]
    call: str  # how fn is called and what it returns
    validate: Callable[["Params"], str | None] | None = None  # the family's own limits (its Triton impl's)


_FAMILIES: dict[str, KernelFamily] = {}


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
