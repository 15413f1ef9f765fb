"""The distinct steps of a trace: a trace of millions of steps repeats a much smaller set of per-DP-rank token
tuples, and what it costs to time a trace grows with that set, not with the step count.

    d = distinct_steps([[3, 5], [8, 1], [3, 5]])
    d.steps == ((3, 5), (8, 1))   # first-appearance order
    d.counts.tolist() == [2, 1]   # how often each occurs
    d.index.tolist() == [0, 1, 0]  # which distinct step each step is: d.steps[d.index[i]] == trace[i]

Computed with numpy over the whole table (a sort of its rows), never with a Python object per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class DistinctSteps:
    steps: tuple[tuple[int, ...], ...]  # the distinct per-DP-rank token tuples, in first-appearance order
    counts: np.ndarray  # int64 [len(steps)]: how many steps are steps[j]
    index: np.ndarray  # int32 [num_steps]: step i is steps[index[i]]

    @property
    def num_steps(self) -> int:
        return int(self.index.shape[0])

    def table(self) -> np.ndarray:
        """int64 [len(steps), dp]: the distinct steps as one array."""
        return np.asarray(self.steps, dtype=np.int64).reshape(len(self.steps), -1)


def distinct_steps(tokens) -> DistinctSteps:
    """The DistinctSteps of `tokens`: [steps][dp] token counts (a list of lists or tuples, or a 2-D integer array;
    every step has the same number of DP ranks). ValueError when it is not such a table."""
    table = np.asarray(tokens)
    if table.ndim == 1 and table.shape[0] == 0:  # [] : no steps
        table = table.reshape(0, 0)
    if table.ndim != 2 or (table.size and table.dtype.kind not in "iu"):
        raise ValueError(f"a trace is [steps][dp] whole numbers, got an array of shape {table.shape} and dtype "
                         f"{table.dtype}")
    if table.shape[0] == 0:
        return DistinctSteps((), np.zeros(0, np.int64), np.zeros(0, np.int32))
    num_steps = table.shape[0]
    if num_steps >= 1 << 31:
        raise ValueError(f"{num_steps:,} steps: more than an int32 index holds")
    _, first, inverse, counts = np.unique(_row_keys(table), return_index=True, return_inverse=True,
                                          return_counts=True)
    # np.unique sorts the keys; renumber the distinct rows by where each first occurs
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    index = rank[inverse.reshape(-1)].astype(np.int32)
    steps = tuple(tuple(row) for row in table[first[order]].tolist())
    return DistinctSteps(steps, counts[order].astype(np.int64), index)


def _row_keys(table: np.ndarray) -> np.ndarray:
    """One int64 per row, equal exactly when the rows are equal: the row read as a mixed-radix number (each
    column's range its radix) when that fits in 62 bits, else the row's rank in a lexicographic sort. Sorting one
    int64 per row is many times faster than np.unique(axis=0), which compares rows as opaque bytes."""
    table = table.astype(np.int64, copy=False)
    low = table.min(axis=0)
    radix = table.max(axis=0) - low + 1
    if float(np.prod(radix.astype(np.float64))) < 2.0 ** 62:
        key = np.zeros(table.shape[0], np.int64)
        for column in range(table.shape[1]):
            key = key * radix[column] + (table[:, column] - low[column])
        return key
    order = np.lexsort(table.T[::-1])  # by column 0, then 1, ...
    ordered = table[order]
    new = np.ones(table.shape[0], bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    key = np.empty(table.shape[0], np.int64)
    key[order] = np.cumsum(new) - 1
    return key
