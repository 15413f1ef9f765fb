"""Shared launch-side helpers for the Triton kernels."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter; anything else is an error."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and not interpreting():
            raise RuntimeError("Triton kernel got a CPU tensor: set TRITON_INTERPRET=1 (before importing triton) "
                               "to run it in Triton's interpreter, or use the *_torch reference")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
