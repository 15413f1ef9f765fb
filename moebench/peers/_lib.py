"""What the library adapters (vllm, sglang, flashinfer) share: finding the library at import
without importing it (find_spec, like deep_ep), importing it on first use, binding a stand-in module in tests,
and registering an adapter as a peer impl through its kernel family.

An adapter is `make(lib) -> fn`, where `lib` is the library's namespace (the real functions, or a stand-in module
with the same call signatures) and `fn` has moebench's signature for the family. Everything a library does
differently (sentinels, output layout, missing arguments) is handled in `fn` or by the family's build, never by a
looser check. An adapter may give `fn` an `info` dict (which library path it takes, what it does around the call):
it lands in the point's record (`case.info`), and what `fn` writes there later (on its first, untimed call) too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from typing import Any, Callable

import torch

from moebench.families import get_family
from moebench.kernels.contract import mask_padded_rows_torch
from moebench.registry import PEERS_PACKAGE, Impl, register

__all__ = ["Library", "libraries", "register_adapter", "accepts", "router_out", "scratch_like", "router_after"]


class Library:
    def __init__(self, name: str, top_module: str, load: Callable[[], Any]):
        self.name = name
        self._load = load  # imports the library, returns its namespace
        self.lib: Any = None
        self.reason: str | None = None
        if importlib.util.find_spec(top_module) is None:
            self.reason = f"{name} is not installed (no module {top_module!r})"

    def bind(self, lib: Any) -> None:
        """Use `lib` (a stand-in module in tests) as the library."""
        self.lib, self.reason = lib, None

    def get(self) -> Any:
        if self.lib is None and self.reason is None:
            try:
                self.lib = self._load()
            except Exception as e:
                self.reason = f"{self.name} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return self.lib

    def available(self, ctx, needs: str) -> str | None:
        lib = self.get()
        if lib is None:
            return self.reason
        if not hasattr(lib, needs):
            return f"this {self.name} has no {needs}"
        if not ctx.is_cuda and not getattr(lib, "MOEBENCH_STANDIN", False):
            return f"{self.name} kernels run on CUDA only"
        return None


def libraries() -> dict[str, Library]:
    """Library name -> Library: the module-level Library of every module of moebench.peers, found by walking the
    package (the tests bind a stand-in to each: tests/standins)."""
    pkg = importlib.import_module(PEERS_PACKAGE)
    found: dict[str, Library] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            for value in vars(importlib.import_module(f"{PEERS_PACKAGE}.{info.name}")).values():
                if isinstance(value, Library):
                    found.setdefault(value.name, value)
    return found


def accepts(fn: Callable, name: str) -> bool:
    """Whether the installed function takes the argument `name` (signatures differ between versions)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def router_out(logits: torch.Tensor, top_k: int, out):
    """The router's output buffers: `out`, or fresh (weights fp32, ids int32) [T, K]."""
    if out is not None:
        return out
    T = logits.shape[0]
    return (torch.empty(T, top_k, dtype=torch.float32, device=logits.device),
            torch.empty(T, top_k, dtype=torch.int32, device=logits.device))


def scratch_like(cache: dict, ids: torch.Tensor) -> torch.Tensor:
    """An int32 buffer shaped like `ids` for an output moebench does not read (token_expert_indices), made once
    per shape and device in `cache` (on the first, untimed call)."""
    key = (tuple(ids.shape), ids.device)
    if key not in cache:
        cache[key] = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    return cache[key]


def router_after(weights: torch.Tensor, ids: torch.Tensor, is_padding: torch.Tensor | None = None, *,
                 new: tuple[torch.Tensor, torch.Tensor] | None = None, renormalize: bool = False):
    """What an adapter does after a router kernel, in this order (timed with it): the kernel's `new` tensors
    (weights, ids) copied into the caller's buffers, the weights renormalised (for a kernel with no such
    argument), rows of `is_padding` set to -1 / 0.0 (pass None where the kernel took the mask). -> (weights, ids)"""
    if new is not None:
        weights.copy_(new[0])
        ids.copy_(new[1])
    if renormalize:
        weights.div_(weights.sum(dim=-1, keepdim=True))
    mask_padded_rows_torch(weights, ids, is_padding)
    return weights, ids


def register_adapter(library: Library, family: str, variant: str, needs: str, make: Callable[[Any], Callable],
                     description: str, *, validate: Callable | None = None, build_for: Callable | None = None,
                     mask_aware: bool = True) -> None:
    """Register `<family>.<variant>` (library=library.name): built through the family's build_for (or the given
    one) with the adapter `make(lib)`. `needs` is the library function it calls (available says when absent)."""
    fam = get_family(family)
    builder = build_for or fam.build_for
    own = fam.validate

    def build(p, ctx):
        fn = make(library.get())
        case = builder(fn)(p, ctx)
        if isinstance(getattr(fn, "info", None), dict):
            case.info.update(fn.info)
            fn.info = case.info  # the adapter's later notes go to the record too
        return case

    def check_point(p):
        return (own(p) if own is not None else None) or (validate(p) if validate is not None else None)

    register(Impl(f"{family}.{variant}", targets=fam.targets, build=build, description=description,
                  available=lambda ctx: library.available(ctx, needs), validate=check_point, mask_aware=mask_aware,
                  library=library.name))
