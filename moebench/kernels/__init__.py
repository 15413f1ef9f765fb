"""moebench.kernels: the MoE kernels as a library, importable alone (it imports nothing of the benchmark harness).

Each module is one op: its Triton kernel(s) and launcher, the plain-torch reference `<op>_torch` that follows
docs/contracts.md literally, and, where the pre-fix behaviour is a function of its own, the mask-oblivious twin
`<op>_oblivious`. Helpers shared by several ops' kernels live in `kernels._details`. The benchmark cases that time
and check these ops are in `moebench.bench`.

The package exports the names of every op module's `__all__` (found by walking this package, so a new op module
is exported without editing this file); two modules exporting one name for different objects is an ImportError.
"""

import importlib as _importlib
import pkgutil as _pkgutil


def _module_exports() -> dict:
    """name -> object over the `__all__` of every non-underscore module of this package, in module name order."""
    exports: dict = {}
    for info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = _importlib.import_module(f"{__name__}.{info.name}")
        names = getattr(module, "__all__", None)
        if names is None:
            raise ImportError(f"{module.__name__}: a kernel module declares __all__ (the names the package exports)")
        for name in names:
            obj = getattr(module, name)
            if exports.get(name, obj) is not obj:
                raise ImportError(f"{__name__}: {name!r} is exported by two modules for different objects "
                                  f"(the second: {module.__name__})")
            exports[name] = obj
    return exports


_EXPORTS = _module_exports()
globals().update(_EXPORTS)
__all__ = sorted(_EXPORTS)
