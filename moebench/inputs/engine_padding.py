"""The padding a serving engine adds to one step, in row counts only: the producers of moebench.inputs.padding
applied in the order an engine applies them, without building a tensor.

A step is every DP rank's real tokens. Per step:
  1. cudagraph  each DP rank pads its real tokens to the smallest capture size >= them (cudagraph_padded_size;
                above the largest size it runs eagerly, unpadded; 0 tokens stay 0)
  2. dp         every DP rank pads to the max of those across the DP ranks (dp_pad): an idle rank runs the
                padded batch too
  3. dbo        with dual-batch overlap the DP-padded batch splits at rows // 2 into two micro-batches (dbo_split)
  4. sp         with sequence parallelism each micro-batch pads to a multiple of sp_size and every SP (TP) rank
                takes its chunk (sp_pad_and_chunk)
Real tokens sit at the head of every batch and padding at its tail (the producers' layout), so the real tokens of
one MoE-layer call (a DP rank x micro-batch x SP rank) follow from the row counts alone. `step_padding` gives the
rows after each producer and every call's (rows, real rows); `producer_calls` gives the same calls read off the
masks the tensor producers themselves make (on zero-width rows), which the serving_trace point checks against and
tests/bench/serving_trace/test_serving_trace.py holds call by call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moebench.inputs.padding import cudagraph_pad, cudagraph_padded_size, dbo_split, dp_pad, sp_pad_and_chunk

PRODUCERS = ("cudagraph", "dp", "sp")  # the producers that add rows (dbo splits, it adds none)


@dataclass(frozen=True)
class Engine:
    capture_sizes: tuple[int, ...]
    dp_size: int = 1
    sp_size: int = 1  # 1: no sequence parallelism
    dbo: bool = False


@dataclass(frozen=True)
class LayerCall:
    """One MoE-layer call of a step: `rows` rows, the first `real` of them real tokens."""

    dp_rank: int
    micro_batch: int
    sp_rank: int
    rows: int
    real: int


@dataclass(frozen=True)
class StepPadding:
    real: tuple[int, ...]  # real tokens per DP rank
    cudagraph_rows: tuple[int, ...]  # rows per DP rank after the capture size
    dp_rows: int  # rows of every DP rank after DP padding
    micro_batch_rows: tuple[int, ...]  # (dp_rows,), or the two DBO halves
    sp_rows: tuple[int, ...]  # per micro-batch: rows after SP padding (a multiple of sp_size)
    chunk_rows: tuple[int, ...]  # per micro-batch: rows of each SP rank's chunk
    calls: tuple[LayerCall, ...]  # every layer call with rows > 0

    @property
    def padded_rows(self) -> int:
        """Padded rows over all the step's layer calls (every DP and SP rank, both micro-batches)."""
        return sum(c.rows - c.real for c in self.calls)

    def added_rows(self) -> dict[str, int]:
        """Padded rows each producer added over the step's DP ranks (they sum to padded_rows)."""
        dp_size = len(self.real)
        return {"cudagraph": sum(c - r for c, r in zip(self.cudagraph_rows, self.real)),
                "dp": sum(self.dp_rows - c for c in self.cudagraph_rows),
                "sp": dp_size * sum(s - m for s, m in zip(self.sp_rows, self.micro_batch_rows))}


def _micro_batches(rows: int, dbo: bool) -> tuple[int, ...]:
    return (rows // 2, rows - rows // 2) if dbo else (rows,)


def step_padding(real: Sequence[int], engine: Engine) -> StepPadding:
    """The rows after each producer for one step whose DP ranks hold `real` tokens (see the module docstring)."""
    if len(real) != engine.dp_size:
        raise ValueError(f"step_padding: {len(real)} DP ranks' tokens for dp_size {engine.dp_size}")
    cudagraph_rows = tuple(cudagraph_padded_size(int(r), engine.capture_sizes) for r in real)
    dp_rows = max(cudagraph_rows)
    halves = _micro_batches(dp_rows, engine.dbo)
    sp = engine.sp_size
    sp_rows = tuple(-(-h // sp) * sp for h in halves)
    chunk_rows = tuple(s // sp for s in sp_rows)
    calls = []
    for dp_rank, real_r in enumerate(real):
        left = int(real_r)  # real tokens not yet placed, head first
        for m, (half, chunk) in enumerate(zip(halves, chunk_rows)):
            real_m = min(left, half)
            left -= real_m
            for sp_rank in range(sp):
                real_c = min(max(real_m - sp_rank * chunk, 0), chunk)
                if chunk:
                    calls.append(LayerCall(dp_rank, m, sp_rank, chunk, real_c))
    return StepPadding(tuple(int(r) for r in real), cudagraph_rows, dp_rows, halves, sp_rows, chunk_rows,
                       tuple(calls))


def producer_calls(real: Sequence[int], engine: Engine) -> tuple[list[int], int, list[tuple[int, int, int, int, int]]]:
    """One step through the tensor producers of moebench.inputs.padding (cudagraph_pad, dp_pad, dbo_split,
    sp_pad_and_chunk) on zero-width rows: (rows per DP rank after the capture size, rows after DP padding, every
    call's (dp rank, micro-batch, sp rank, rows, real rows) read off its mask). What step_padding must equal."""
    def rows(n: int) -> torch.Tensor:
        return torch.empty((n, 0))

    padded = [cudagraph_pad(rows(int(r)), list(engine.capture_sizes))[1] for r in real]
    cudagraph_rows = [m.shape[0] for m in padded]
    calls, dp_rows = [], 0
    for d, mask in enumerate(padded):
        x, mask = dp_pad(rows(mask.shape[0]), cudagraph_rows, is_padding=mask)
        dp_rows = mask.shape[0]
        halves = list(dbo_split(x, mask)) if engine.dbo else [(x, mask)]
        for m, (xm, mm) in enumerate(halves):
            for s in range(engine.sp_size):
                _, chunk = sp_pad_and_chunk(xm, mm, engine.sp_size, s)
                if chunk.shape[0]:
                    calls.append((d, m, s, chunk.shape[0], int((~chunk).sum())))
    return cudagraph_rows, dp_rows, calls


def padding_problem(step: StepPadding, engine: Engine) -> str | None:
    """Why `step` differs from what the tensor producers make of its real tokens, or None."""
    cudagraph_rows, dp_rows, calls = producer_calls(step.real, engine)
    got = [(c.dp_rank, c.micro_batch, c.sp_rank, c.rows, c.real) for c in step.calls]
    if list(step.cudagraph_rows) != cudagraph_rows or step.dp_rows != dp_rows or got != calls:
        return (f"real {list(step.real)}: rows {list(step.cudagraph_rows)} / {step.dp_rows} / calls {got[:4]}, the "
                f"producers make {cudagraph_rows} / {dp_rows} / {calls[:4]}")
    return None
