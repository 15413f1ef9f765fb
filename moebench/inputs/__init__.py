"""Benchmark inputs: seeded batches (`batch`), real-token logit priors (`routing`), padding producers and fills
(`padding`), seeded expert weights (`weights`)."""

from moebench.inputs.batch import Batch, generator, make_batch, route  # noqa: F401
from moebench.inputs.weights import cached_expert_weights, make_expert_weights  # noqa: F401
