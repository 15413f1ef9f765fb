"""Test-suite only (tests/conftest.py puts this folder on PYTHONPATH, so the pytest process, the point worker and
spawned gloo ranks all load it): a numpy path for xor reductions in Triton's CPU interpreter.

Triton 3.x's interpreter evaluates `tl.reduce` in numpy for sum/min/max/argmin/argmax but falls back to a Python
loop over every element (`ReduceOps.generic_reduce`, one combine_fn call per element) for any other combine. The
bitonic `tl.sort` (moe_align_block_size's scatter, the routers' sorts) calls `xor_sum` in every compare-and-swap
stage, so that loop is most of an interpreted sort. xor is associative and commutative on integers, so
`np.bitwise_xor.reduce` gives the same bits; kernel source, launch and compiled (GPU) behaviour are untouched,
and nothing is imported early: the patch is applied when triton.runtime.interpreter itself is first imported.
MOEBENCH_TEST_NO_INTERP_FASTPATH=1 turns it off (to compare, or to rule it out)."""

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
