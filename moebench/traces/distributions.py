"""Every seeded distribution of real tokens per step: jit_trace's batch sizes and serving_trace's per-DP-rank
streams draw from here (`batch_sizes`, `rank_tokens`).

The serving mixes. Each step of a DP rank is a decode step (one token per running sequence: DECODE tokens, uniform over 1..decode_top)
or a step carrying a prefill chunk (uniform over decode_top+1..max_tokens, or the whole budget `max_tokens`, as a
chunked prefill fills it), drawn with the shares below; max_tokens is the sweep's trace_max_tokens (the engine's
token budget per step). With max_tokens <= decode_top every step is a decode step.

  chat           decode-heavy chat: 92% decode steps of 1..64 tokens, 8% prefill chunks
  mixed          70% decode steps of 1..256, 30% prefill chunks (a fifth of them the whole budget)
  prefill_heavy  25% decode steps of 1..256, 75% prefill chunks (half of them the whole budget)

The batch-size distributions, over 1..max_tokens:
  uniform         uniform over 1..max_tokens;
  decode_prefill  DECODE_SHARE of the steps are decode batches uniform over 1..DECODE_MAX_TOKENS, the rest
                  prefill chunks uniform over DECODE_MAX_TOKENS+1..max_tokens;
  lognormal       round(exp(N(mu, sigma))) clipped to [1, max_tokens] with mu = ln(max_tokens)/2 (median
                  sqrt(max_tokens)) and sigma = ln(max_tokens)/6 (+-3 sigma spans [1, max_tokens]).

One stream (`batch_sizes`, jit_trace's trace) draws a serving mix as DP rank 0 does; per DP rank (`rank_tokens`,
serving_trace's trace) a batch-size distribution draws one stream per rank from its own seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SEED_SALT = 0x5E27  # keeps the serving mixes' streams apart from the other seeded inputs of the same seed
DECODE_SHARE = 0.9  # decode_prefill: share of decode steps
DECODE_MAX_TOKENS = 256  # decode_prefill: largest decode batch
TRACE_SEED_SALT = 4242  # batch sizes draw from their own stream, not the inputs' one


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


def batch_sizes(distribution: str, steps: int, max_tokens: int, seed: int) -> list[int]:
    """`steps` batch sizes in 1..max_tokens, one seeded stream: a serving mix as DP rank 0 draws it, else one of
    uniform, decode_prefill, lognormal (the module docstring)."""
    top = int(max_tokens)
    if distribution in SERVING_MIXES:
        return serving_tokens(distribution, steps, top, seed, 0)
    rng = random.Random(seed * 1_000_003 + TRACE_SEED_SALT)
    sizes = []
    for _ in range(steps):
        if distribution == "uniform":
            b = rng.randint(1, top)
        elif distribution == "decode_prefill":
            decode_top = min(DECODE_MAX_TOKENS, top)
            if decode_top == top or rng.random() < DECODE_SHARE:
                b = rng.randint(1, decode_top)
            else:
                b = rng.randint(decode_top + 1, top)
        elif distribution == "lognormal":
            log_top = math.log(top)
            b = int(round(math.exp(rng.gauss(log_top / 2, log_top / 6))))
        else:
            raise ValueError(f"unknown trace_distribution {distribution!r}")
        sizes.append(min(max(b, 1), top))
    return sizes


def rank_tokens(distribution: str, steps: int, max_tokens: int, seed: int, dp_rank: int) -> list[int]:
    """`steps` real-token counts of DP rank `dp_rank`: a serving mix's stream of that rank, else the batch sizes
    drawn from the rank's own seed (seed * 131 + dp_rank)."""
    if distribution in SERVING_MIXES:
        return serving_tokens(distribution, steps, max_tokens, seed, dp_rank)
    return batch_sizes(distribution, steps, max_tokens, seed * 131 + dp_rank)
