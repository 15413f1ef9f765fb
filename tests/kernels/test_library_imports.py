"""moebench.kernels is a library a serving engineer can import alone: it imports nothing of the benchmark harness,
exports every op with its reference, and no module of moebench imports another module's private names."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import moebench.kernels as kernels

HARNESS = ("registry", "runner", "sweep", "inputs", "results", "bench", "plots", "profiling", "profile", "cli",
           "check", "dispatch")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_import_without_the_harness():
    """Every harness module made unimportable (sys.modules[name] = None), then the whole library imported."""
    blocked = ", ".join(repr(f"moebench.{m}") for m in HARNESS)
    code = (f"import sys\nfor name in ({blocked},):\n    sys.modules[name] = None\n"
            "import pkgutil, importlib, moebench.kernels as k\n"
            "for m in pkgutil.walk_packages(k.__path__, 'moebench.kernels.'):\n    importlib.import_module(m.name)\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _kernel_modules():
    for info in pkgutil.iter_modules(kernels.__path__):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"moebench.kernels.{info.name}")


def test_package_exports_every_modules_all_and_every_op_with_its_reference():
    """The package's exports are the union of its modules' `__all__` (no module left out, none listed by hand); an
    op module (one holding a function of its own name) exports the op, and the package its `<op>_torch` too."""
    modules = list(_kernel_modules())
    union = {name for m in modules for name in m.__all__}
    assert set(kernels.__all__) == union
    ops = [m.__name__.rsplit(".", 1)[1] for m in modules if callable(getattr(m, m.__name__.rsplit(".", 1)[1], None))]
    assert {"fused_experts", "fused_experts_fp8", "topk_softmax", "masked_moe_sum"} <= set(ops)
    for op in ops:
        assert op in union and f"{op}_torch" in union, op
        assert callable(getattr(kernels, op)) and callable(getattr(kernels, f"{op}_torch")), op


def _private_imports(path: Path) -> list[str]:
    """`from x import _name` and `module._name` where module is an imported moebench module."""
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moebench"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("moebench")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.value.id}.{node.attr}")
    return [f"{path.relative_to(ROOT)}: {f}" for f in found]


def test_no_private_names_across_library_and_bench_modules():
    paths = [p for sub in ("kernels", "bench", "inputs") for p in (ROOT / "moebench" / sub).rglob("*.py")]
    paths += [ROOT / "moebench" / name for name in ("check.py", "registry.py")]
    assert [f for p in paths for f in _private_imports(p)] == []
