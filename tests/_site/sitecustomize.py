"""Test-suite only (tests/conftest.py puts this folder on PYTHONPATH, so the pytest process, the point worker and
spawned gloo ranks all load it): cheaper evaluations inside Triton's CPU interpreter, same results.

Triton 3.x's interpreter evaluates `tl.reduce` in numpy for sum/min/max/argmin/argmax but falls back to a Python
loop over every element (`ReduceOps.generic_reduce`, one combine_fn call per element) for any other combine. The
bitonic `tl.sort` (moe_align_block_size's scatter, the routers' sorts) calls `xor_sum` in every compare-and-swap
stage, so that loop is most of an interpreted sort. xor is associative and commutative on integers, so
`np.bitwise_xor.reduce` gives the same bits; kernel source, launch and compiled (GPU) behaviour are untouched,
and nothing is imported early: the patch is applied when triton.runtime.interpreter itself is first imported.
Second, the interpreter's _patch_builtin lists each package's builtins once instead of per call (see _patch).
Third, a device-function call inside a launch skips re-patching what the launch already patched
(_patch_device_calls); fourth, _get_np_dtype's fixed table is looked up once per dtype (_memoize_np_dtype).
MOEBENCH_TEST_NO_INTERP_FASTPATH=1 turns them all off (to compare, or to rule them out). A subprocess started
with its own PYTHONPATH (the install test, the docs example) runs without them: slower, otherwise the same.

Nothing is patched unless TRITON_INTERPRET is set (a GPU run never calls these functions). Each patch replaces
interpreter internals read in the Triton versions CHECKED_AGAINST names for it; on any other installed Triton this
module raises at load (tests/conftest.py loads it first, so the test run stops there) naming
the patches and the version: read the patched functions in that version's triton/runtime/interpreter.py and add it
to CHECKED_AGAINST, or set MOEBENCH_TEST_UNCHECKED_TRITON=1 to apply the patches unchecked.

One more, not Triton's (also only with TRITON_INTERPRET set; MOEBENCH_TEST_NO_GC_SCOPE=1 turns it off): each point's
closing gc.collect() walks only what that point made (_scope_point_collection)."""

import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys

TARGET = "triton.runtime.interpreter"
UNCHECKED_ENV = "MOEBENCH_TEST_UNCHECKED_TRITON"
# The Triton versions whose source each patch was read against (the functions it replaces or relies on, named in
# its docstring): a version not listed here may have changed them.
CHECKED_AGAINST = {
    "_patch_xor_reduce": ("3.9.0",),
    "_patch_builtin_names": ("3.9.0",),
    "_patch_device_calls": ("3.9.0",),
    "_memoize_np_dtype": ("3.9.0",),
}


class UncheckedTritonError(RuntimeError):
    pass


def check_triton_version(version: str | None, environ=os.environ) -> None:
    """Raise UncheckedTritonError when a patch was not checked against `version` (None: Triton is not installed,
    nothing to patch), unless UNCHECKED_ENV=1 is set."""
    if version is None or environ.get(UNCHECKED_ENV) == "1":
        return
    unchecked = [f"{name} (checked against Triton {', '.join(versions)})"
                 for name, versions in CHECKED_AGAINST.items() if version not in versions]
    if unchecked:
        raise UncheckedTritonError(
            f"tests/_site/sitecustomize.py: the Triton interpreter patches {'; '.join(unchecked)} were not checked "
            f"against the installed Triton {version}: read the functions each replaces in that version's "
            f"triton/runtime/interpreter.py and add it to CHECKED_AGAINST, or set {UNCHECKED_ENV}=1 to apply them "
            f"unchecked (MOEBENCH_TEST_NO_INTERP_FASTPATH=1 turns them off)")


def installed_triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _patch(mod) -> None:
    tl = getattr(mod, "tl", None)
    ReduceOps = getattr(mod, "ReduceOps", None)
    if ReduceOps is None or tl is None or getattr(ReduceOps, "_moebench_xor_fastpath", False):
        return
    _patch_xor_reduce(ReduceOps, tl)
    _patch_builtin_names(mod, tl)
    _patch_device_calls(mod, tl)
    _memoize_np_dtype(mod, tl)


def _patch_xor_reduce(ReduceOps, tl) -> None:
    """First: ReduceOps.apply_impl (numpy for sum/min/max/argmin/argmax, else generic_reduce's per-element loop)
    takes tl.standard._xor_combine (xor_sum's combine) to np.bitwise_xor.reduce over the one input's data."""
    import numpy as np

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


def _patch_builtin_names(mod, tl) -> None:
    """Second: _patch_builtin, relying on _patch_attr's lambda keeping the builtin as its keyword default `member`
    and on tl.core.is_builtin."""
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


def _patch_device_calls(mod, tl) -> None:
    """Third: a @jit device-function call inside a launch re-runs _patch_lang (every builtin of tl, tl.core,
    tl.tensor, tl.math looked at again, the tensor and core attributes set again) and drops the scope it returns,
    so it changes nothing that the launch's own _patch_lang did not already do when the function sees only the
    language modules the launch patched: the builtins are already the interpreter's (none left to patch), the
    other attributes get equal replacements that the launch's restore undoes all the same. That call is skipped;
    any other (a launch, a device function seeing another language module, a call outside a launch) runs as
    before. Relies on _patch_lang patching only tl and tl.core's builtins, tensor and core attributes and
    tl.core.tensor_descriptor_base (the same in every call), and on GridExecutor.__call__ being the launch."""
    patch_lang, executor = getattr(mod, "_patch_lang", None), getattr(mod, "GridExecutor", None)
    if patch_lang is None or executor is None or getattr(executor, "_moebench_launch_scope", False):
        return
    launches: list = []  # per launch in progress: the language modules patched in it (None: not yet)

    class _Unchanged:
        def restore(self) -> None:
            pass

    def langs_of(fn) -> frozenset:
        core = tl.core
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is core)

    def _patch_lang(fn):
        if launches and launches[-1] is not None:
            langs = langs_of(fn)
            if langs and langs <= launches[-1]:
                return _Unchanged()
            scope = patch_lang(fn)
            launches[-1] = launches[-1] | langs
            return scope
        scope = patch_lang(fn)
        if launches:
            launches[-1] = langs_of(fn)
        return scope

    launch = executor.__call__

    def __call__(self, *args, **kwargs):
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    mod._patch_lang = _patch_lang
    executor.__call__ = __call__
    executor._moebench_launch_scope = True


def _memoize_np_dtype(mod, tl) -> None:
    """Fourth: _get_np_dtype builds its 19-entry dict of triton -> numpy dtypes on every call (hashing each key);
    the table is fixed, so each scalar dtype's answer is kept after its first lookup (pointers and blocks are
    unwrapped exactly as there)."""
    slow = getattr(mod, "_get_np_dtype", None)
    if slow is None or getattr(slow, "_moebench_memo", False):
        return
    import numpy as np

    uint64 = np.dtype(np.uint64)
    memo: dict = {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return uint64
            tt_dtype = tt_dtype.element_ty
        got = memo.get(tt_dtype)
        if got is None:
            got = memo[tt_dtype] = slow(tt_dtype)
        return got

    _get_np_dtype._moebench_memo = True
    mod._get_np_dtype = _get_np_dtype


def _scope_point_collection(mod) -> None:
    """moebench.run.point.execute_point ends every point with a full gc.collect() (what the point left, its GPU
    memory above all, freed before the next one), which walks every object the process holds: some 0.1 s in a point
    worker and up to 0.7 s in a pytest worker that holds the whole session, a quarter of a second a point on average
    over the CPU suite's ~250 points (about 60 s of a 2-core run). Here each point runs between gc.freeze() and
    gc.unfreeze() (both O(1)): the objects alive before the point are left out of its collection, so that walks
    only what the point made, which is everything the point's collection is there for; the older objects go back to
    the oldest generation afterwards, collected by the interpreter's own collections as before. The records are the
    same."""
    import functools
    import gc

    run = getattr(mod, "execute_point", None)
    if run is None or getattr(run, "_moebench_gc_scope", False):
        return

    @functools.wraps(run)
    def execute_point(*args, **kwargs):
        gc.freeze()
        try:
            return run(*args, **kwargs)
        finally:
            gc.unfreeze()

    execute_point._moebench_gc_scope = True
    mod.execute_point = execute_point


class _Finder(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` right after `target` is first imported (once; this finder then leaves sys.meta_path)."""

    def __init__(self, target: str, patch) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _on_import(target: str, patch) -> None:
    if target in sys.modules:
        patch(sys.modules[target])
    else:
        sys.meta_path.insert(0, _Finder(target, patch))


# only where the kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET without a GPU): a GPU run
# never calls the patched functions, whatever its Triton
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")
if os.environ.get("MOEBENCH_TEST_NO_INTERP_FASTPATH") != "1" and _INTERPRETING:
    check_triton_version(installed_triton_version())
    _on_import(TARGET, _patch)
# a GPU run of the suite keeps the full collection: there it frees device memory that a point's cycles may hold
if os.environ.get("MOEBENCH_TEST_NO_GC_SCOPE") != "1" and _INTERPRETING:
    _on_import("moebench.run.point", _scope_point_collection)
