"""How fast this machine is right now, against the rates the run's estimate assumes (moebench.measure.cost): one
interpreted Triton call (masked_moe_sum.triton, 32 rows) timed, over its estimate. A CPU shared with other work runs
it 2-4x slower; the estimate-vs-wall test divides wall times by this figure, measured beside each of them."""

from __future__ import annotations

import statistics
import time

import torch

from moebench import registry
from moebench.measure.cost import DeviceRates
from moebench.params import Params
from moebench.registry import RunContext

REFERENCE = ("masked_moe_sum.triton", dict(num_tokens=32, num_experts=16, top_k=2, hidden=64))


def slowdown(calls: int = 3) -> float:
    """Measured seconds of the reference call (median of `calls`, after one warm-up) over its estimate."""
    name, params = REFERENCE
    impl, p = registry.get(name), Params(**params)
    case = impl.build(p, RunContext(torch.device("cpu")))
    case.run()
    took = []
    for _ in range(calls):
        start = time.perf_counter()
        case.run()
        took.append(time.perf_counter() - start)
    return statistics.median(took) / registry.work_of(impl).call_s(p, DeviceRates("interpreter"))
