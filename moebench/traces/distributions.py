"""Seeded serving-like distributions of real tokens per step, one independent stream per DP rank.

Each step of a DP rank is a decode step (one token per running sequence: DECODE tokens, uniform over 1..decode_top)
or a step carrying a prefill chunk (uniform over decode_top+1..max_tokens, or the whole budget `max_tokens`, as a
chunked prefill fills it), drawn with the shares below; max_tokens is the sweep's trace_max_tokens (the engine's
token budget per step). With max_tokens <= decode_top every step is a decode step.

  chat           decode-heavy chat: 92% decode steps of 1..64 tokens, 8% prefill chunks
  mixed          70% decode steps of 1..256, 30% prefill chunks (a fifth of them the whole budget)
  prefill_heavy  25% decode steps of 1..256, 75% prefill chunks (half of them the whole budget)

jit_trace's three distributions (uniform, decode_prefill, lognormal) are moebench.bench.jit_trace's own
(trace_batch_sizes); the serving-trace bench draws them per DP rank with that function.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED_SALT = 0x5E27  # keeps these streams apart from the other seeded inputs of the same seed


@dataclass(frozen=True)
class StepMix:
    decode_share: float  # steps without a prefill chunk
    decode_top: int  # decode steps: 1..decode_top tokens
    full_budget_share: float  # of the prefill steps: those that fill the whole token budget


SERVING_MIXES: dict[str, StepMix] = {
    "chat": StepMix(0.92, 64, 0.0),
    "mixed": StepMix(0.70, 256, 0.2),
    "prefill_heavy": StepMix(0.25, 256, 0.5),
}


def rank_stream_seed(seed: int, dp_rank: int) -> int:
    return (seed * 1_000_003 + SEED_SALT) * 131 + dp_rank


def serving_tokens(distribution: str, steps: int, max_tokens: int, seed: int, dp_rank: int) -> list[int]:
    """`steps` real-token counts of DP rank `dp_rank`, drawn from SERVING_MIXES[distribution]."""
    mix = SERVING_MIXES[distribution]
    rng = random.Random(rank_stream_seed(seed, dp_rank))
    decode_top = min(mix.decode_top, max_tokens)
    out = []
    for _ in range(steps):
        if decode_top == max_tokens or rng.random() < mix.decode_share:
            out.append(rng.randint(1, decode_top))
        elif rng.random() < mix.full_budget_share:
            out.append(max_tokens)
        else:
            out.append(rng.randint(decode_top + 1, max_tokens))
    return out
