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

    def call_counts(self, weights) -> dict[tuple[int, int], int]:
        """{(rows, real): calls of that shape over the steps, each step's calls counted `weights[s]` times}."""
        rows, real = self.rows.reshape(self.num_steps, -1), self.real.reshape(self.num_steps, -1)
        on = rows > 0
        w = np.broadcast_to(np.asarray(weights, dtype=np.int64)[:, None], rows.shape)[on]
        base = int(real.max(initial=0)) + 1
        keys, at = np.unique(rows[on] * base + real[on], return_inverse=True)
        total = np.zeros(len(keys), dtype=np.int64)
        np.add.at(total, at, w)
        return {(int(k // base), int(k % base)): int(n) for k, n in zip(keys.tolist(), total.tolist())}

    def step(self, i: int) -> StepPadding:
        """Step i as step_padding gives it (one object per step: what is built of a step is kept by its id)."""
        made = self.__dict__.setdefault("_steps", {})
        if i not in made:
            made[i] = self._step(i)
        return made[i]

    def _step(self, i: int) -> StepPadding:
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


def shapes_as_steps(shapes) -> list[StepPadding]:
    """The call shapes (rows, real) as the calls of one StepPadding: for the functions of compose.py that read only
    the calls' shapes (distinct_shapes, interpolation_shapes, ...), without a step object per distinct step."""
    calls = tuple(LayerCall(0, 0, 0, int(r), int(q)) for r, q in shapes)
    return [StepPadding((), (), 0, (), (), (), calls)]


CHECKED_STEPS = 2_000  # distinct steps a point checks against the tensor producers (all of a shorter trace)


def check_sample(num_steps: int, limit: int = CHECKED_STEPS) -> np.ndarray:
    """Which distinct steps a point checks against the tensor producers (each a few tensor ops): all of them up to
    `limit`, else an even spread of `limit` with the first and last (step_calls itself is held equal to
    step_padding on every step by the tests)."""
    if num_steps <= limit:
        return np.arange(num_steps)
    return np.unique(np.round(np.linspace(0, num_steps - 1, limit)).astype(np.int64))
