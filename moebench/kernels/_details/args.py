"""Argument checks shared by the kernels' launchers and references."""

from __future__ import annotations

import torch


def check_mask(is_padding: torch.Tensor | None, rows: int) -> None:
    """The one size check every masked entry point makes: a mask of the wrong length is an error, never a silent
    broadcast (the context-parallel bug of seed 001)."""
    if is_padding is None:
        return
    if is_padding.dim() != 1 or is_padding.shape[0] != rows:
        got = is_padding.shape[0] if is_padding.dim() == 1 else tuple(is_padding.shape)
        raise ValueError(f"is_padding size mismatch, expected: {rows}, got: {got}")
