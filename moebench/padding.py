"""Where padded rows come from (the producers of SPEC.md) and what they contain (the fill modes).

`is_padding` is a bool [T] mask, True = not a real token.
"""

from __future__ import annotations

import torch

FILLS = ("zeros", "repeat", "stale", "random")


def check_mask(is_padding: torch.Tensor | None, rows: int) -> None:
    """The one size check every masked entry point makes (SPEC: never a silent broadcast)."""
    if is_padding is None:
        return
    if is_padding.dim() != 1 or is_padding.shape[0] != rows:
        got = is_padding.shape[0] if is_padding.dim() == 1 else tuple(is_padding.shape)
        raise ValueError(f"is_padding size mismatch, expected: {rows}, got: {got}")


def ratio_mask(num_tokens: int, padding_ratio: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `ratio` producer: the trailing round(T * ratio) rows are padding."""
    num_padding = int(round(num_tokens * padding_ratio))
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    if num_padding:
        mask[num_tokens - num_padding:] = True
    return mask


def fill_rows(rows: torch.Tensor, is_padding: torch.Tensor, fill: str, *, generator: torch.Generator,
              stale: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite the padded rows of `rows` ([T, D], in place) according to `fill` and return it.

    zeros:  all-zero rows.
    repeat: copies of the first real row (what padded input id 0 gives after embedding).
    stale:  rows left over from a previous batch (`stale`, same shape; drawn fresh when not given).
    random: fresh N(0, 1) rows.
    """
    if fill not in FILLS:
        raise ValueError(f"unknown padding fill {fill!r} (one of {', '.join(FILLS)})")
    check_mask(is_padding, rows.shape[0])
    idx = is_padding.nonzero().flatten()
    if idx.numel() == 0:
        return rows
    if fill == "zeros":
        rows[idx] = 0
    elif fill == "repeat":
        real = (~is_padding).nonzero().flatten()
        src = real[0] if real.numel() else idx[0]
        rows[idx] = rows[src].unsqueeze(0).expand(idx.numel(), -1)
    elif fill == "stale":
        if stale is None:
            stale = torch.randn(rows.shape, generator=generator, device=rows.device, dtype=torch.float32)
        rows[idx] = stale[idx].to(rows.dtype)
    else:
        fresh = torch.randn((idx.numel(), rows.shape[1]), generator=generator, device=rows.device,
                            dtype=torch.float32)
        rows[idx] = fresh.to(rows.dtype)
    return rows
