"""Triton kernel launches as profiler ranges when the kernels run in Triton's interpreter.

On a GPU torch.profiler and nsys see each Triton kernel as device work. In Triton's CPU interpreter
(TRITON_INTERPRET=1) a launch is Python and numpy work on the host that torch.profiler does not see as one
thing: only the torch allocations and copies it makes (aten::empty, aten::set_, ...) show up. While
`interpreted_kernel_ranges()` is active, every interpreted launch runs inside a record_function range
`triton/<kernel name>`, so a CPU profile lists the kernels of each stage with their interpreter time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

KERNEL_RANGE_PREFIX = "triton/"  # `triton/<kernel name>`: one interpreted kernel launch


def kernel_range_name(kernel: str) -> str:
    return f"{KERNEL_RANGE_PREFIX}{kernel}"


@contextmanager
def interpreted_kernel_ranges() -> Iterator[bool]:
    """Wrap every interpreted Triton launch in a `triton/<kernel name>` record_function range while active.
    Yields whether it could (False outside the interpreter, or when this Triton has no InterpretedFunction.run:
    the profile then lists the torch ops of each range instead). Launches outside the block are untouched."""
    from torch.autograd.profiler import record_function

    from moebench.measure.interpreted_launches import patched_interpreted_launches

    def wrap(original):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):  # a warm-up launch does no work in the interpreter
                return original(self, *args, **kwargs)
            with record_function(kernel_range_name(self.fn.__name__)):
                return original(self, *args, **kwargs)
        return run

    with patched_interpreted_launches(wrap) as patched:
        yield patched
