"""Stand-ins for libraries that cannot be brought here (vLLM, SGLang's sgl_kernel, FlashInfer): plain-torch
modules with those libraries' exact call signatures and output conventions (in-place outputs, sentinels, bucket
layouts), so moebench's adapters can be tested on the CPU. They are not the libraries: passing against them says
the adapters handle the documented conventions, not that the real kernels agree with moebench."""

import importlib
import pkgutil
from types import ModuleType


def standins() -> dict[str, ModuleType]:
    """Library name -> its stand-in: every module of this package whose `MOEBENCH_STANDIN` names the
    moebench.peers Library it stands in for (a new stand-in module is found, not listed)."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            if isinstance(getattr(module, "MOEBENCH_STANDIN", None), str):
                found[module.MOEBENCH_STANDIN] = module
    return found
