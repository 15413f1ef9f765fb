"""Test-suite only (tests/conftest.py puts this folder on PYTHONPATH, so the pytest process, the point worker and
spawned gloo ranks all load it): two cheaper evaluations inside Triton's CPU interpreter, same results.

Triton 3.x's interpreter evaluates `tl.reduce` in numpy for sum/min/max/argmin/argmax but falls back to a Python
loop over every element (`ReduceOps.generic_reduce`, one combine_fn call per element) for any other combine. The
bitonic `tl.sort` (moe_align_block_size's scatter, the routers' sorts) calls `xor_sum` in every compare-and-swap
stage, so that loop is most of an interpreted sort. xor is associative and commutative on integers, so
`np.bitwise_xor.reduce` gives the same bits; kernel source, launch and compiled (GPU) behaviour are untouched,
and nothing is imported early: the patch is applied when triton.runtime.interpreter itself is first imported.
Second, the interpreter's _patch_builtin lists each package's builtins once instead of per call (see _patch).
MOEBENCH_TEST_NO_INTERP_FASTPATH=1 turns both off (to compare, or to rule them out). A subprocess started with
its own PYTHONPATH (the install test, the docs example) runs without them: slower, otherwise the same."""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "triton.runtime.interpreter"


def _patch(mod) -> None:
    import numpy as np

    ReduceOps = getattr(mod, "ReduceOps", None)
    tl = getattr(mod, "tl", None)
    if ReduceOps is None or tl is None or getattr(ReduceOps, "_moebench_xor_fastpath", False):
        return
    slow = ReduceOps.apply_impl

    def apply_impl(self, input):
        # looked up per call: triton.language may still be half-imported when the interpreter module loads
        if len(input) == 1 and self.combine_fn is getattr(tl.standard, "_xor_combine", None):
            data = input[0].handle.data
            out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(out, input[0].dtype)
        return slow(self, input)

    ReduceOps.apply_impl = apply_impl
    ReduceOps._moebench_xor_fastpath = True

    # _patch_builtin runs inspect.getmembers (dir, a getattr and is_builtin per member, a sort) over tl, tl.core,
    # tl.tensor, tl.math... on every launch and on every @jit device-function call: in the routers' kernels that
    # is half the interpreter's time. The names it can patch are fixed (the builtins of each package), so they
    # are listed once per package and the same check (is_builtin of the current member) is made on those alone,
    # in the same (sorted) order. A name already patched (a nested call) holds _patch_attr's lambda, whose
    # keyword default `member` is the builtin: it is listed too, and skipped as before (not a builtin now).
    patch_builtin, patch_attr, inspect = getattr(mod, "_patch_builtin", None), getattr(mod, "_patch_attr", None), \
        getattr(mod, "inspect", None)
    if patch_builtin is None or patch_attr is None or inspect is None:
        return
    names_of: dict[int, tuple] = {}

    def _builtin_names(pkg):
        is_builtin = tl.core.is_builtin
        names = []
        for name, member in inspect.getmembers(pkg):
            original = (getattr(member, "__kwdefaults__", None) or {}).get("member", member)
            if is_builtin(member) or is_builtin(original):
                names.append(name)
        return (pkg, tuple(names))

    def _patch_builtin(pkg, builder, scope):
        entry = names_of.get(id(pkg))
        if entry is None or entry[0] is not pkg:
            entry = names_of[id(pkg)] = _builtin_names(pkg)
        is_builtin = tl.core.is_builtin
        for name in entry[1]:
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    mod._patch_builtin = _patch_builtin


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MOEBENCH_TEST_NO_INTERP_FASTPATH") != "1":
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _Finder())
