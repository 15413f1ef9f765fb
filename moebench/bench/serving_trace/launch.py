"""The expert kernel's launch config as the cost models see it: what of it the cost depends on (`Launch`: its name,
BLOCK_M and pairing), the launch the kernel picks at a row count on a device (`launch_of`, `launches_of`), and the
row tiles a launch issues (`row_tiles`, the one formula the rank and shape models count)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Launch:
    """What of a launch config the cost depends on: its name (config.short()), BLOCK_M and pairing."""

    name: str
    block_m: int
    paired: bool = False

    def row_tiles(self, counts: Sequence[int]) -> int:
        return int(row_tiles(np.asarray([counts], dtype=np.int64), np.asarray([self.block_m]),
                             np.asarray([self.paired]))[0])


def row_tiles(counts: np.ndarray, block_m: np.ndarray, paired: np.ndarray) -> np.ndarray:
    """The row tiles of each of N launches: counts int [N, E] routes to each expert, block_m int [N], paired bool
    [N] -> int64 [N]: per expert ceil(count / BLOCK_M) blocks, a paired config's full tiles of two blocks plus an
    odd last one."""
    blocks = -(-np.asarray(counts, dtype=np.int64) // np.asarray(block_m, dtype=np.int64)[:, None])
    return np.where(np.asarray(paired, dtype=bool), ((blocks + 1) // 2).sum(axis=1), blocks.sum(axis=1))


def launch_of(p, device) -> Callable[[int], Launch]:
    """rows -> the Launch the rank's expert kernel picks for that many rows on `device` (cached per rows)."""
    from moebench.kernels.fused_experts import experts_choice
    from moebench.kernels.fused_experts_fp8 import fp8_choice

    seen: dict[int, Launch] = {}

    def of(rows: int) -> Launch:
        got = seen.get(rows)
        if got is None:
            dims = (max(1, rows), p.top_k, p.local_experts, p.hidden, p.intermediate)
            if p.expert_dtype == "fp8":
                cfg = fp8_choice(*dims, device, group_size=p.group_size, scale_format=p.scale_format).config
            else:
                cfg = experts_choice(*dims, device).config
            got = seen[rows] = Launch(cfg.short(), cfg.block_m, cfg.paired)
        return got
    return of


def launches_of(launch_of: Callable[[int], Launch], rows: Sequence[int]) -> list[Launch]:
    """launch_of of each of the sorted distinct `rows`, asking launch_of at few of them: a launch is a step function
    of the rows that is constant over each power-of-two bucket of the tuned tables (T = next_pow2(rows)) where a
    table names it, and where a rule picks it, monotone in the rows (thresholds on rows per expert: a longer run of
    rows never returns to a smaller tile). So within a bucket, equal launches at both ends of a run of rows are the
    launch of the whole run, and only the runs whose ends differ are split (a trace's 10^5 distinct rank rows take
    a few hundred lookups)."""
    rows = [int(r) for r in rows]
    out: list[Launch | None] = [None] * len(rows)

    def fill(lo: int, hi: int, a: Launch, b: Launch) -> None:  # rows[lo] has a, rows[hi] has b
        if a == b:
            out[lo:hi + 1] = [a] * (hi - lo + 1)
            return
        if hi - lo <= 1:
            out[lo], out[hi] = a, b
            return
        mid = (lo + hi) // 2
        m = launch_of(rows[mid])
        fill(lo, mid, a, m)
        fill(mid, hi, m, b)

    start = 0
    while start < len(rows):
        bucket = 1 << max(0, rows[start] - 1).bit_length()
        end = start
        while end + 1 < len(rows) and rows[end + 1] <= bucket:
            end += 1
        fill(start, end, launch_of(rows[start]), launch_of(rows[end]))
        start = end + 1
    return out  # type: ignore[return-value]
