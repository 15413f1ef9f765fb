"""How many Triton kernel launches a call made in Triton's interpreter (TRITON_INTERPRET=1).

Under the interpreter the process is in interpreter mode for every point, but only some impls launch Triton kernels
(a pure-torch impl, a plugin or a library peer may launch none): the record's timing mode says `interp` only for a
point whose timed region launched an interpreted kernel (moebench.records.timing_label), `wall` for the others.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def patched_interpreted_launches(wrap: Callable[[Callable], Callable]) -> Iterator[bool]:
    """Route every interpreted Triton launch inside the block through `wrap(original_run)`; yields whether it could
    (False outside the interpreter, or with a Triton that has no InterpretedFunction.run to patch). The profiler's
    kernel ranges and the launch count both go through here."""
    from moebench.kernels.runtime import interpreting

    if not interpreting():
        yield False
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # a Triton without the interpreter module
        yield False
        return
    original = InterpretedFunction.__dict__.get("run")
    if original is None:
        yield False
        return
    InterpretedFunction.run = wrap(original)
    try:
        yield True
    finally:
        InterpretedFunction.run = original


@contextmanager
def counting_interpreted_launches() -> Iterator[list[int] | None]:
    """Yield a one-element list counting the interpreted Triton launches made inside the block, or None outside
    the interpreter (or with a Triton that has no InterpretedFunction.run to count through)."""
    count = [0]

    def wrap(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):  # a warm-up launch does no work in the interpreter
                count[0] += 1
            return original(self, *args, **kwargs)
        return run

    with patched_interpreted_launches(wrap) as patched:
        yield count if patched else None
