"""Plugins: a user's own kernel or dispatch path through moebench's sweeps, without editing moebench.

    from moebench.plugins import register_kernel

    def my_router(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None): ...
    register_kernel("topk_softmax", "mine", my_router)      # -> the impl topk_softmax.mine

`fn` has exactly the signature of `moebench.kernels.<family>` (moebench.families gives, per family, how it is
called and what it must return). moebench builds the inputs, checks `fn` against the family's reference (a wrong
result is recorded `wrong`), times it and computes imbalance, exactly as for its own kernels. The impl is marked
`library="plugin"` (a peer: tables and plots give every impl its ratio to the best peer).

A sweep names the modules to import under the top-level key `plugins: [module, ...]`: a module name or a path to a
.py file, found beside the sweep file, then in the current directory (the sweep loader turns what it finds there
into the file's absolute path: docs/sweeps.md#paths-in-a-sweep), else on sys.path. Installed packages can register
through the entry-point group `moebench.impls` (each entry point's object is called with no arguments when
callable, else importing it is the registration). A module that cannot be imported is a one-line error naming it.
Dispatch paths: `register_dispatch_path(name, cls)` with a `moebench.dispatch.base.DispatchPath` subclass, timed as
`dispatch.<name>`. docs/plugins.md has a worked example.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Callable

__all__ = ["register_kernel", "register_dispatch_path", "load_plugins", "load_entry_points", "ENTRY_POINT_GROUP",
           "PluginError"]

ENTRY_POINT_GROUP = "moebench.impls"


class PluginError(ValueError):
    """A plugin that cannot be loaded. str() is the one line shown to the user (exit 2)."""


def register_kernel(family: str, variant: str, fn: Callable, *, description: str = "", library: str = "plugin",
                    available: Callable | None = None, validate: Callable | None = None) -> str:
    """Register `fn` as the impl `<family>.<variant>` (see the module docstring); returns the impl name.

    `available(ctx)` / `validate(p)` (None when fine, else why not) add to the family's own limits.
    """
    from moebench.families import get_family, signature_problem
    from moebench.registry import register_impl

    fam = get_family(family)
    if not variant or "." in variant:
        raise ValueError(f"plugin variant {variant!r}: a non-empty name without dots")
    why = signature_problem(fam, fn)
    if why:
        raise PluginError(f"register_kernel {family}.{variant}: {getattr(fn, '__name__', 'fn')} {why}")
    own = fam.validate

    def both(p):
        return (own(p) if own is not None else None) or (validate(p) if validate is not None else None)

    name = f"{family}.{variant}"
    _registering_modules.add(getattr(fn, "__module__", None) or "__main__")
    register_impl(name, targets=fam.targets, description=description or f"{library}: {getattr(fn, '__name__', fn)}",
                  available=available, validate=both, library=library)(fam.build_for(fn))
    return name


def register_dispatch_path(name: str, cls: type) -> str:
    """Register a DispatchPath subclass as the multi-rank impl `dispatch.<name>` (the path interface of
    moebench.dispatch.base; checked and timed like moebench's own paths)."""
    from moebench.dispatch.base import dispatch_path
    from moebench.families import path_registrar

    description = getattr(cls, "description", "") or f"plugin dispatch path {cls.__name__}"
    _registering_modules.add(getattr(cls, "__module__", None) or "__main__")
    dispatch_path(name, description=description)(cls)
    path_registrar()(cls)
    return f"dispatch.{name}"


_loaded_modules: set[str] = set()
_registering_modules: set[str] = set()  # where registered functions and classes live (the point worker imports them)


def imported_modules() -> list[str]:
    """The plugin modules this process imported and those its registered impls were defined in: what a fresh
    process (the point worker) imports to see the same impls."""
    return sorted(_loaded_modules | _registering_modules)


def load_plugins(modules: list, src: str = "<memory>") -> None:
    """Import each plugin module once (registration happens at import): a module name (from sys.path) or a path to
    its .py file (its folder, or the folder above its package, joins sys.path so that the point worker and the
    ranks import it by name too). Any failure is one PluginError line naming the entry. Installed packages' entry
    points first."""
    from moebench import registry

    registry.load_all()  # the families must exist before a plugin registers against them
    load_entry_points()
    for i, entry in enumerate(modules):
        if not isinstance(entry, str) or not entry:
            raise PluginError(f"{src}: plugins[{i}]: expected a module name, got {entry!r}")
        is_file = entry.endswith(".py")
        try:
            mod = _import_file(Path(entry)) if is_file else entry
            if mod in _loaded_modules:
                continue
            importlib.import_module(mod)
        except PluginError as e:  # already one line naming what is wrong
            raise PluginError(f"{src}: plugins[{i}]: {entry}: {e}") from None
        except Exception as e:
            what = f"plugin file {entry}" if is_file else f"plugin module {entry!r}"
            raise PluginError(f"{src}: plugins[{i}]: cannot import {what} "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        _loaded_modules.add(mod)


def _import_file(path: Path) -> str:
    """Import the top-level module or package of a .py file from the file's own folder (ahead of any other of that
    name on sys.path; one already imported stays) and return the file's module name: pkg/sub/mod.py (pkg and sub
    holding an __init__.py) is pkg.sub.mod, from the folder above pkg. That folder joins sys.path, so the point
    worker and the ranks find the module by name."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    path = path.resolve()
    parts = [] if path.stem == "__init__" else [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        parts.insert(0, root.name)
        root = root.parent
    if str(root) not in sys.path:
        sys.path.append(str(root))
    top = parts[0]
    if top not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec(top, [str(root)])
        if spec is None or spec.loader is None:
            raise ImportError(f"no module {top} in {root}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[top] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[top]
            raise
    return ".".join(parts)


_entry_points_loaded = False


def load_entry_points() -> None:
    """Load the `moebench.impls` entry points of installed packages, once."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except Exception as e:
            raise PluginError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
