"""Counting Triton JIT compiles through `triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`.

Triton calls the cache hook when a kernel's in-memory cache misses (a new specialisation: constexpr values,
argument types, divisibility/alignment, num_warps...) right before compiling, and the post-compile hook right
after, both with keyword arguments `key, repr, fn (module, name, jit_function), compile (signature, constants,
configs, num_warps, num_stages, device, is_warmup, ...), is_manual_warmup, already_compiled` (triton 3.6 and 3.9
alike). A truthy return from the cache hook tells Triton to skip the compile, so ours always returns whatever the
hook it chains to returns.

A compile served from the on-disk cache (`triton_cache_dir()`) still counts: the in-memory cache missed and a
new specialisation was loaded. Each event says whether the disk cache hit (`disk_cache_hit`): the kernel's cache
entry `<cache dir>/<base32 hash>/` holding only files older than the cache hook's call means it was loaded, not
built. It is None when that cannot be told (a custom TRITON_CACHE_MANAGER, async compile mode, entry missing).

Under the interpreter (TRITON_INTERPRET=1) kernels are `InterpretedFunction`s that never call the hooks, and
without a GPU nothing compiles: `JitCounter.supported` is then False and the summary says "unsupported" (never 0).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

UNSUPPORTED = "unsupported"


def triton_cache_dir() -> str:
    """Triton's on-disk kernel cache: triton.knobs.cache.dir, else $TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache."""
    try:
        import triton

        d = triton.knobs.cache.dir
        if d:
            return str(d)
    except Exception:  # an older triton without knobs, or none at all
        pass
    env = os.environ.get("TRITON_CACHE_DIR")
    if env:
        return env
    return os.path.join(os.environ.get("TRITON_HOME", os.path.expanduser("~")), ".triton", "cache")


def unsupported_reason() -> str | None:
    """Why compile counting cannot work in this process, or None when it can."""
    try:
        import triton
    except Exception as e:  # pragma: no cover - triton is a dependency
        return f"triton does not import ({type(e).__name__})"
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return f"triton {triton.__version__} has no knobs.runtime.jit_cache_hook / jit_post_compile_hook"
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    try:
        interpret = interpret or bool(runtime.interpret)
    except Exception:
        pass
    if interpret:
        return "TRITON_INTERPRET=1: interpreted kernels are not compiled and do not call the JIT hooks"
    import torch

    if not torch.cuda.is_available():
        return "no GPU: Triton kernels cannot compile in this process"
    return None


def fresh_kernel(kernel: Any) -> Any:
    """A new JIT function for the same Python function as `kernel` (a @triton.jit function): its in-memory kernel
    cache starts empty, whatever ran before in this process, so a JitCounter sees every specialisation it needs.
    The on-disk cache is shared (keyed by source): an earlier process's builds are found there, which each
    CompileEvent's `disk_cache_hit` tells."""
    import triton

    return triton.jit(kernel.fn)


class _Supported:
    """`JitCounter.supported` on the class or an instance: re-evaluated on each read (env can change)."""

    def __get__(self, obj, owner=None) -> bool:
        return unsupported_reason() is None


@dataclass
class CompileEvent:
    kernel: str  # the @triton.jit function's qualified name
    module: str
    key: str  # the specialisation: "constexprs | signature | options", see _spec_key
    compile_s: float | None  # cache hook -> post-compile hook; None when the post hook never came
    warmup: bool  # compiled by an explicit kernel.warmup(...) rather than a launch
    disk_cache_hit: bool | None  # loaded from triton_cache_dir() rather than built; None = cannot tell
    device: int | None = None
    completed: bool = True  # False: the compile raised (no post-compile hook)


def _arg_name(path: Any, arg_names: list[str]) -> str:
    """A constexpr/attr path (tuple of indices into the arguments, deeper for tuple args) -> 'NAME[1]'."""
    if not isinstance(path, tuple) or not path:
        return str(path)
    head = arg_names[path[0]] if isinstance(path[0], int) and path[0] < len(arg_names) else str(path[0])
    return head + "".join(f"[{i}]" for i in path[1:])


def _spec_key(fn_info: Any, compile_info: dict) -> str:
    """A short, stable string for one specialisation: 'BLOCK=64, ACT=silu | x:*bf16%16, n:i32 | w4 s3'."""
    jit_fn = getattr(fn_info, "jit_function", None)
    arg_names = list(getattr(jit_fn, "arg_names", None) or [])
    constants = compile_info.get("constants") or {}
    consts = ", ".join(f"{_arg_name(path, arg_names)}={getattr(v, 'value', v)}" for path, v in constants.items())
    attrs: dict[str, str] = {}
    configs = compile_info.get("configs") or [{}]
    for path, pairs in (configs[0] or {}).items():
        marks = []
        for pair in pairs or ():
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                name, val = pair
                marks.append(f"%{val}" if "divisib" in str(name) else f"@{name}={val}")
        if marks:
            attrs[_arg_name(path, arg_names)] = "".join(marks)
    sig_parts = []
    for name, ty in (compile_info.get("signature") or {}).items():
        if ty == "constexpr":
            continue
        name = getattr(name, "name", name)
        sig_parts.append(f"{name}:{ty}{attrs.get(str(name), '')}")
    opts = f"w{compile_info.get('num_warps')} s{compile_info.get('num_stages')}"
    return f"{consts} | {', '.join(sig_parts)} | {opts}"


def _base32(hex_key: str) -> str:
    import base64

    return base64.b32encode(bytes.fromhex(hex_key)).decode("utf-8").rstrip("=")


def _disk_cache_hit(fn_info: Any, key: Any, device: Any, started_ns: int) -> bool | None:
    """Whether the compile that just finished was a load from the on-disk cache (see the module docstring)."""
    if os.environ.get("TRITON_CACHE_MANAGER") or os.environ.get("TRITON_REMOTE_CACHE_BACKEND"):
        return None
    try:
        kernel_cache = fn_info.jit_function.device_caches[device][0]
        kernel = kernel_cache.get(key)
        entry = os.path.join(triton_cache_dir(), _base32(kernel.hash))
        newest = max(os.stat(os.path.join(entry, f)).st_mtime_ns for f in os.listdir(entry))
    except Exception:  # async futures, other layouts, a missing entry: cannot tell cheaply
        return None
    return newest < started_ns


class JitCounter:
    """Records every Triton compile while active. A context manager (also usable via __enter__/__exit__):

        with JitCounter() as jit:
            run_kernels()
        jit.count, jit.seconds, jit.events, jit.summary()

    Nestable and safe with hooks already set: it chains to the hooks present on entry (their return value is
    passed through) and puts them back on exit. If someone else replaced our hook meanwhile, exit leaves theirs
    in place and our hook only forwards from then on.
    """

    supported = _Supported()

    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._pending: dict[tuple, tuple[int, float, Any, Any]] = {}
        self._lock = threading.Lock()
        self._active = False
        self._prev_cache: Callable | None = None
        self._prev_post: Callable | None = None
        self._entered = False
        self._reason: str | None = None  # unsupported_reason() as of __enter__
        self._runtime = None

    # -- the hooks -------------------------------------------------------------------------------------------
    def _cache_hook(self, **kwargs: Any) -> Any:
        skip = self._prev_cache(**kwargs) if self._prev_cache is not None else None
        if self._active and not skip:  # a skipped compile (previous hook said so) compiles nothing
            compile_info = kwargs.get("compile") or {}
            fn_info = kwargs.get("fn")
            ident = (id(fn_info.jit_function) if fn_info is not None else None, kwargs.get("key"),
                     compile_info.get("device"))
            with self._lock:
                self._pending[ident] = (time.time_ns(), time.perf_counter(), fn_info, compile_info)
        return skip

    def _post_hook(self, **kwargs: Any) -> Any:
        t_end = time.perf_counter()
        result = self._prev_post(**kwargs) if self._prev_post is not None else None
        if not self._active:
            return result
        compile_info = kwargs.get("compile") or {}
        fn_info = kwargs.get("fn")
        key = kwargs.get("key")
        ident = (id(fn_info.jit_function) if fn_info is not None else None, key, compile_info.get("device"))
        with self._lock:
            pending = self._pending.pop(ident, None)
        if pending is None:  # compile started before we were installed: no start time
            started_ns, seconds = None, None
        else:
            started_ns, seconds = pending[0], t_end - pending[1]
        disk = _disk_cache_hit(fn_info, key, compile_info.get("device"), started_ns) if started_ns else None
        self._record(fn_info, compile_info, kwargs, seconds, disk, completed=True)
        return result

    def _record(self, fn_info: Any, compile_info: dict, kwargs: dict, seconds: float | None,
                disk: bool | None, completed: bool) -> None:
        warmup = bool(kwargs.get("is_manual_warmup", compile_info.get("is_warmup", False)))
        device = compile_info.get("device")
        event = CompileEvent(kernel=str(getattr(fn_info, "name", "?")), module=str(getattr(fn_info, "module", "?")),
                             key=_spec_key(fn_info, compile_info), compile_s=seconds, warmup=warmup,
                             disk_cache_hit=disk, device=device if isinstance(device, int) else None,
                             completed=completed)
        with self._lock:
            self.events.append(event)

    # -- context manager -------------------------------------------------------------------------------------
    def __enter__(self) -> "JitCounter":
        if self._runtime is not None:
            raise RuntimeError("JitCounter is already active")
        self._reason = unsupported_reason()
        self._entered = True
        try:
            import triton

            runtime = triton.knobs.runtime
            self._prev_cache = runtime.jit_cache_hook
            self._prev_post = runtime.jit_post_compile_hook
            runtime.jit_cache_hook = self._cache_hook
            runtime.jit_post_compile_hook = self._post_hook
            self._runtime = runtime
        except Exception:  # no knobs: nothing to hook (the reason says unsupported)
            self._runtime = None
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            if runtime.jit_cache_hook == self._cache_hook:
                runtime.jit_cache_hook = self._prev_cache
            if runtime.jit_post_compile_hook == self._post_hook:
                runtime.jit_post_compile_hook = self._prev_post
        with self._lock:
            unfinished = list(self._pending.values())
            self._pending.clear()
        for _, _, fn_info, compile_info in unfinished:  # a compile that raised never reached the post hook
            self._record(fn_info, compile_info, {}, None, None, completed=False)

    # -- results ---------------------------------------------------------------------------------------------
    def _why_not(self) -> str | None:
        return self._reason if self._entered else unsupported_reason()

    @property
    def counting(self) -> bool:
        """Whether this counter's figures are meaningful (hooks fire in this process)."""
        return self._why_not() is None

    @property
    def count(self) -> int | None:
        """Completed compiles so far; None when counting is unsupported here (never a misleading 0)."""
        if not self.counting:
            return None
        return sum(1 for e in self.events if e.completed)

    @property
    def seconds(self) -> float | None:
        """Total compile seconds of the completed compiles; None when unsupported."""
        if not self.counting:
            return None
        return sum(e.compile_s or 0.0 for e in self.events if e.completed)

    def summary(self) -> dict[str, Any]:
        """JSON-able: {"compiles", "compile_s", "kernels": [...], "supported", "cache_dir", ...}.

        Unsupported: compiles and compile_s are the string "unsupported" and "reason" says why.
        """
        reason = self._why_not()
        cache_dir = triton_cache_dir()
        if reason is not None:
            return {"supported": False, "compiles": UNSUPPORTED, "compile_s": UNSUPPORTED, "kernels": [],
                    "reason": reason, "cache_dir": cache_dir}
        done = [e for e in self.events if e.completed]
        hits = [e.disk_cache_hit for e in done]
        by_kernel: dict[str, int] = {}
        for e in done:
            by_kernel[e.kernel] = by_kernel.get(e.kernel, 0) + 1
        out: dict[str, Any] = {
            "supported": True,
            "compiles": len(done),
            "compile_s": round(sum(e.compile_s or 0.0 for e in done), 6),
            "kernels": [asdict(e) for e in self.events],
            "per_kernel": by_kernel,
            "warmup_compiles": sum(1 for e in done if e.warmup),
            "disk_cache_hits": sum(1 for h in hits if h is True),
            "disk_cache_unknown": sum(1 for h in hits if h is None),
            "cache_dir": cache_dir,
        }
        failed = len(self.events) - len(done)
        if failed:
            out["failed_compiles"] = failed
        return out
