"""What the peer tests share: a point's Params, an impl built and checked on the CPU, a library bound to its
stand-in for the length of a test."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from moebench import registry
from moebench.params import Params
from moebench.registry import RunContext

CPU = RunContext(device=torch.device("cpu"))


def params(**over) -> Params:
    return dataclasses.replace(Params(), **over)


def checked(name: str, p: Params):
    """(case, its check) of impl `name` at `p`, which must be valid and available here."""
    impl = registry.get(name)
    assert impl.validate(p) is None, impl.validate(p)
    assert impl.available(CPU) is None, impl.available(CPU)
    case = impl.build(p, CPU)
    return case, case.check()


@contextlib.contextmanager
def bound(library, standin):
    """`library` (a peers._lib.Library) using `standin`, restored afterwards."""
    saved = library.lib, library.reason, library.origin
    library.bind(standin)
    try:
        yield
    finally:
        library.lib, library.reason, library.origin = saved
