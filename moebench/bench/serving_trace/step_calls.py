"""Every distinct step's layer calls as arrays: moebench.inputs.engine_padding.step_padding for all steps at once.

A step's calls are one per DP rank d, micro-batch m and SP rank j: `rows[s, d, m, j]` rows of which the first
`real[s, d, m, j]` are real tokens (rows 0: no call, as step_padding leaves a zero-row chunk out). The producers'
arithmetic, vectorised: capture size (the smallest size >= the real tokens, unpadded above the largest, 0 stays 0),
the DP max, the DBO halves (rows // 2 and the rest), SP padding to a multiple of sp_size and each SP rank's chunk,
real tokens at the head of every batch. tests/bench/serving_trace/test_step_calls.py holds it equal to step_padding
call by call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebench.inputs.engine_padding import Engine, LayerCall, StepPadding


@dataclass(frozen=True)
class StepCalls:
    """The calls of S steps: `real_tokens` int64 [S, DP]; `rows`, `real` int64 [S, DP, M, SP] (M = 2 with DBO);
    `micro_batch_rows` int64 [S, M]; `chunk_rows` int64 [S, M] (rows of each SP rank's chunk; 0: no call in that
    micro-batch); `cudagraph_rows` int64 [S, DP]; `dp_rows` int64 [S]."""

    real_tokens: np.ndarray
    cudagraph_rows: np.ndarray
    dp_rows: np.ndarray
    micro_batch_rows: np.ndarray
    chunk_rows: np.ndarray
    rows: np.ndarray
    real: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.real_tokens.shape[0])

    @property
    def present(self) -> np.ndarray:
        """bool [S, M]: the micro-batches that hold calls."""
        return self.chunk_rows > 0

    def padded_rows(self) -> np.ndarray:
        """int64 [S]: padded rows over each step's calls."""
        return (self.rows - self.real).sum(axis=(1, 2, 3))

    def total_rows(self) -> np.ndarray:
        """int64 [S]: rows over each step's calls."""
        return self.rows.sum(axis=(1, 2, 3))

    def take(self, index) -> "StepCalls":
        """The steps at `index` (an int array or a slice)."""
        return StepCalls(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    def step(self, i: int) -> StepPadding:
        """Step i as step_padding gives it."""
        sp = self.rows.shape[3]
        calls = tuple(LayerCall(d, m, j, int(self.rows[i, d, m, j]), int(self.real[i, d, m, j]))
                      for d in range(self.rows.shape[1]) for m in range(self.rows.shape[2]) for j in range(sp)
                      if self.rows[i, d, m, j])
        mb = tuple(int(v) for v in self.micro_batch_rows[i])
        chunk = tuple(int(v) for v in self.chunk_rows[i])
        return StepPadding(tuple(int(v) for v in self.real_tokens[i]), tuple(int(v) for v in self.cudagraph_rows[i]),
                           int(self.dp_rows[i]), mb, tuple(c * sp for c in chunk), chunk, calls)


def cudagraph_rows_of(real: np.ndarray, capture_sizes) -> np.ndarray:
    """cudagraph_padded_size of every count: the smallest capture size >= it; itself above the largest; 0 for 0."""
    sizes = np.asarray(sorted(int(s) for s in capture_sizes), dtype=np.int64)
    real = np.asarray(real, dtype=np.int64)
    at = np.searchsorted(sizes, real, side="left")
    padded = np.where(at < len(sizes), sizes[np.minimum(at, len(sizes) - 1)], real)
    return np.where(real == 0, 0, padded)


def step_calls(real_tokens, engine: Engine) -> StepCalls:
    """The calls of every step whose DP ranks hold `real_tokens` (int [S, DP]) under `engine`."""
    real_tokens = np.asarray(real_tokens, dtype=np.int64).reshape(-1, engine.dp_size)
    cg = cudagraph_rows_of(real_tokens, engine.capture_sizes)
    dp_rows = cg.max(axis=1) if cg.shape[1] else np.zeros(len(cg), dtype=np.int64)
    halves = np.stack([dp_rows // 2, dp_rows - dp_rows // 2], axis=1) if engine.dbo else dp_rows[:, None]
    sp = engine.sp_size
    chunk = -(-halves // sp)  # each SP rank's chunk of the micro-batch padded to a multiple of sp
    S, DP, M = real_tokens.shape[0], engine.dp_size, halves.shape[1]
    real = np.zeros((S, DP, M, sp), dtype=np.int64)
    left = real_tokens.copy()  # real tokens not yet placed, head first
    for m in range(M):
        real_m = np.minimum(left, halves[:, m:m + 1])
        left -= real_m
        for j in range(sp):
            real[:, :, m, j] = np.clip(real_m - j * chunk[:, m:m + 1], 0, chunk[:, m:m + 1])
    rows = np.broadcast_to(chunk[:, None, :, None], (S, DP, M, sp)).copy()
    return StepCalls(real_tokens, cg, dp_rows, halves, chunk, rows, real)
