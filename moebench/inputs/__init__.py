"""Benchmark inputs: seeded batches (`batch`), real-token logit priors (`routing`), padding producers and fills
(`padding`)."""

from moebench.inputs.batch import Batch, generator, make_batch, padding_mask, route  # noqa: F401
