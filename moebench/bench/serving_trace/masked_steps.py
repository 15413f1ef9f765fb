"""One figure per masked EP step in a run: with neither SP nor DBO a masked step's work is its real tokens' alone
(padded rows route nowhere and send nothing), whatever the capture list, the trace it came from, or the size the
capture search pads it to. Every point of a run at one EP configuration (`config_key`) reads, for a step whose real
tokens it has seen, the figures the first point composed (`MaskedStepStore.share`), as a rank workload has one time
in the run (rank_timing.RankStore). Otherwise each point's rank model, fitted on its own timings, would read the same
workloads a little differently, and the masked side of lists that do the same work would differ by the model's noise.

A step with no padded row does the same work on both sides, so its oblivious figures are its masked ones
(`share_steps`): the tax of a list that pads nothing is 0 to the bit, whichever point first composed its steps.
The store is the run's (RunContext.run_store): nothing outlives the run; a point at another configuration starts it
afresh. With SP or DBO the padded size moves real tokens between chunks and micro-batches, so each point composes
its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.shapes import layer_key
from moebench.dispatch.pack import CapacityKnobs
from moebench.params import Params

# what a step's masked EP step does not depend on: the trace it came from, the capture list, how much is measured
_STEP_FREE = ServingKnobs.MEASUREMENT | {"trace_file"}


def shares_masked_steps(p: Params) -> bool:
    """Whether a masked step's figures depend on its real tokens alone at this point (no SP, no DBO)."""
    serving = p.knobs(ServingKnobs)
    return serving.sp_size == 1 and not serving.dbo


def config_key(p: Params, device: torch.device) -> tuple:
    """What a masked step's figures depend on besides its real tokens: the layer point (shapes.layer_key), the
    engine's DP layout and the wire (ServingKnobs but the trace file and the budgets) and the capacity keys."""
    serving = p.knobs(ServingKnobs)
    engine = tuple((f.name, repr(getattr(serving, f.name))) for f in dataclasses.fields(ServingKnobs)
                   if f.name not in _STEP_FREE)
    capacity = tuple(sorted((k, repr(v)) for k, v in dataclasses.asdict(p.knobs(CapacityKnobs)).items()))
    return layer_key(p, device), engine, capacity


class MaskedStepStore:
    """{a step's real tokens per DP rank: its masked EP-step figures (ep_arrays.COLUMNS)} for one run at one EP
    configuration."""

    RUN_STORE_KEY = "serving_trace.masked_steps"

    def __init__(self):
        self.key: tuple | None = None
        self.index: dict[bytes, int] = {}
        self.values: dict[str, np.ndarray] = {}

    @classmethod
    def of_run(cls, run_store: dict) -> "MaskedStepStore":
        return run_store.setdefault(cls.RUN_STORE_KEY, cls())

    def for_config(self, key: tuple) -> "MaskedStepStore":
        """The store at configuration `key`; another configuration's figures are dropped first."""
        if self.key != key:
            self.key, self.index, self.values = key, {}, {}
        return self

    def __len__(self) -> int:
        return len(self.index)

    def share(self, real_tokens: np.ndarray, columns: dict[str, np.ndarray]) -> int:
        """In place: each step of `real_tokens` [S, DP] takes the figures its real tokens have in the store, or, the
        first time they come (in the store or in this call), its own, which the store keeps. Returns how many
        steps read figures composed by an earlier point."""
        real_tokens = np.ascontiguousarray(real_tokens, dtype=np.int64)
        if not len(real_tokens):
            return 0
        distinct, first, inverse = np.unique(real_tokens, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        keys = [row.tobytes() for row in distinct]
        at = np.fromiter((self.index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        new = np.flatnonzero(at < 0)
        base = len(self.index)
        for j, i in enumerate(new.tolist()):
            self.index[keys[i]] = base + j
        at[new] = base + np.arange(len(new))
        for name, column in columns.items():
            kept = self.values.get(name)
            added = column[first[new]]
            self.values[name] = added if kept is None else np.concatenate([kept, added])
            column[:] = self.values[name][at[inverse]]
        return int((at[inverse] < base).sum())


def share_steps(store: MaskedStepStore, calls, sides: dict[str, dict[str, np.ndarray]]) -> int:
    """The run's masked figures for every step of `calls` (step_calls.StepCalls), and each step with no padded row
    given its masked figures on the oblivious side too; in place. Returns MaskedStepStore.share's count."""
    shared = store.share(calls.real_tokens, sides["masked"])
    unpadded = (calls.rows == calls.real).all(axis=(1, 2, 3))
    for name, column in sides["oblivious"].items():
        column[unpadded] = sides["masked"][name][unpadded]
    return shared
