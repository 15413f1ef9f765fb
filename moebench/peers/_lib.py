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
import sys
from typing import Any, Callable

import torch

from moebench.families import get_family
from moebench.kernels.contract import mask_padded_rows_torch
from moebench.registry import PEERS_PACKAGE, Impl, register

__all__ = ["Library", "libraries", "register_adapter", "accepts", "router_out", "scratch_like", "router_after"]


class Library:
    """One peer library: found without importing it, imported on first use (`get`), or bound to a stand-in.

    `vendored`: module paths of copies bundled inside another package, tried in order when `top_module` is not
    installed (vLLM's wheel carries DeepGEMM and triton_kernels as `vllm.third_party.*`; vLLM imports the top-level
    module first and falls back to its copy, aliasing the copy as the top-level name, which the copy's own absolute
    imports need). `origin` says what was loaded: the copy ("installed", "vendored", "stand-in"), the module, its
    file and version; `status()` is the records' `adapter_status`."""

    def __init__(self, name: str, top_module: str, load: Callable[[], Any], vendored: tuple[str, ...] = ()):
        self.name = name
        self.top_module = top_module
        self._load = load  # imports the library (as top_module), returns its namespace
        self.lib: Any = None
        self.reason: str | None = None
        self.origin: dict[str, Any] | None = None
        self._source: str | None = top_module
        if not _installed(top_module):
            self._source = next((v for v in vendored if _findable(v)), None)
            if self._source is None:
                where = "".join(f" or {v!r}" for v in vendored)
                self.reason = f"{name} is not installed (no module {top_module!r}{where})"

    def bind(self, lib: Any) -> None:
        """Use `lib` (a stand-in module in tests) as the library."""
        self.lib, self.reason = lib, None
        self.origin = {"copy": "stand-in", "module": getattr(lib, "__name__", type(lib).__name__),
                       "version": getattr(lib, "__version__", None)}

    def get(self) -> Any:
        if self.lib is None and self.reason is None:
            try:
                module = importlib.import_module(self._source)
                if self._source != self.top_module:  # the bundled copy under the name its code imports itself by
                    sys.modules.setdefault(self.top_module, module)
                self.lib = self._load()
                self.origin = {"copy": "installed" if self._source == self.top_module else "vendored",
                               "module": self._source, "path": getattr(module, "__file__", None),
                               "version": _version(module, self._source)}
            except Exception as e:
                self.reason = f"{self.name} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return self.lib

    def status(self) -> str:
        """What a record's `adapter_status` says: the real library and which copy ran, or the stand-in."""
        o = self.origin
        if o is None:
            return f"{self.name} not loaded: {self.reason}"
        version = f" {o['version']}" if o.get("version") else ""
        if o["copy"] == "stand-in":
            return f"stand-in for {self.name} ({o['module']}{version}), not the real library"
        return f"real {self.name}{version}, {o['copy']} copy {o['module']} ({o['path']})"

    def available(self, ctx, needs: str) -> str | None:
        lib = self.get()
        if lib is None:
            return self.reason
        if not hasattr(lib, needs):
            return f"this {self.name} has no {needs}"
        if not ctx.is_cuda and not getattr(lib, "MOEBENCH_STANDIN", False):
            return f"{self.name} kernels run on CUDA only"
        return None


def _installed(module: str) -> bool:
    """Whether `module` is on the path as a module or regular package: a bare namespace package (a directory without
    __init__.py, e.g. the `vllm/` that holds only a copy of vllm/third_party) is not the library."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


def _findable(module: str) -> bool:
    """Whether `module` can be imported (its parent packages are imported to look: a broken parent is a no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # noqa: BLE001 - a parent package that fails to import
        return False


def _version(module: Any, source: str) -> str | None:
    """The module's __version__, else its distribution's, else (a bundled copy) the bundling package's."""
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata

    top = source.split(".")[0]
    try:
        dist = metadata.version(top)
    except metadata.PackageNotFoundError:
        return None
    return dist if top == source else f"bundled with {top} {dist}"


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
        case.info["adapter_status"] = library.status()
        return case

    def check_point(p):
        return (own(p) if own is not None else None) or (validate(p) if validate is not None else None)

    register(Impl(f"{family}.{variant}", targets=fam.targets, build=build, description=description,
                  available=lambda ctx: library.available(ctx, needs), validate=check_point, mask_aware=mask_aware,
                  library=library.name))
