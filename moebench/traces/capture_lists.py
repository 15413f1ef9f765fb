"""Named CUDA-graph capture lists (`capture_sizes: NAME` in a sweep), and the one resolver from a sweep value (a
name, an explicit list, or null) to the sorted sizes a cudagraph producer pads to.

Each list is a rule, not a copy of one engine's release: the engines change their defaults between versions.
  default  1, 2, 4, 8, then multiples of 8 up to 512 (docs/contracts.md#padding-producers; 67 graphs)
  pow2     1, 2, 4, ..., 512 (10 graphs: few captures, up to half the rows padded)
  step16   1, 2, 4, 8, then multiples of 16 up to 512 (35 graphs)
  fine     1, 2, 4, 8, multiples of 8 below 256, multiples of 16 from 256 to 512 (the shape of recent vLLM
           defaults: 51 graphs)
  dense    every size 1..512 (512 graphs: no cudagraph padding at all below 512, the most graph memory)
"""

from __future__ import annotations

from typing import Sequence

MAX_CAPTURE = 512


def _named() -> dict[str, list[int]]:
    return {
        "default": [1, 2, 4] + list(range(8, MAX_CAPTURE + 1, 8)),
        "pow2": [1 << i for i in range(MAX_CAPTURE.bit_length())],
        "step16": [1, 2, 4, 8] + list(range(16, MAX_CAPTURE + 1, 16)),
        "fine": [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, MAX_CAPTURE + 1, 16)),
        "dense": list(range(1, MAX_CAPTURE + 1)),
    }


CAPTURE_LISTS: dict[str, list[int]] = _named()


def capture_list_problem(value) -> str | None:
    """Why `value` (a sweep's capture_sizes) is not a capture list, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in CAPTURE_LISTS:
            return f"unknown capture list {value!r} (one of {', '.join(CAPTURE_LISTS)}, or a list of sizes)"
        return None
    if not value or min(value) < 1:
        return "must be a non-empty list of positive ints"
    return None


def resolve_capture_sizes(value: str | Sequence[int] | None) -> list[int]:
    """The sorted capture sizes of a sweep value: a name of CAPTURE_LISTS, an explicit list, or None (default)."""
    if value is None:
        return list(CAPTURE_LISTS["default"])
    if isinstance(value, str):
        why = capture_list_problem(value)
        if why:
            raise ValueError(f"capture_sizes: {why}")
        return list(CAPTURE_LISTS[value])
    return sorted(int(v) for v in value)


def capture_list_label(value: str | Sequence[int] | None) -> str:
    """How a capture list is named in tables and plots: its name, or `list of N (max M)`."""
    if value is None:
        return "default"
    if isinstance(value, str):
        return value
    sizes = resolve_capture_sizes(value)
    return f"list of {len(sizes)} (max {sizes[-1]})"
