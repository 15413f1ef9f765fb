"""What a capacity policy costs on the wire: the fixed-capacity all-to-all moves whole blocks (seed 000).

`jit_trace.a2a_fixed` counts the compiles each capacity policy (exact / pow2 / max) needs over a batch-size trace;
this is the other side of the trade. An a2a_fixed step sends ep_size blocks of `capacity` wire rows (the
RowLayout row: hidden states + ids + weights + source row) whatever the real counts are, so a larger capacity is
more bytes through the all-to-all. The pack and combine kernels themselves do not get slower with the capacity
(their grid is over the batch's rows), so timing them would show no cost at all.

`jit_trace.a2a_fixed_wire` takes the same trace and the same per-step capacities as `jit_trace.a2a_fixed` (same
seeds, same routing: moebench.bench.jit_trace.step_inputs) and times, as one sample, the whole trace's wire traffic:
for every step one device copy of its ep_size * capacity wire rows, which is what the loopback all-to-all of a
one-GPU process does. That is the lower bound of the cost: across real EP ranks the same bytes cross NVLink or
the network, several times slower than a device copy. info: wire_rows and sent_rows (rows carrying a real
(token, destination) pair) summed over the trace, their ratio (wire_overhead), wire_bytes, mean_capacity.
"""

from __future__ import annotations

import torch

from moebench.params import Params
from moebench.measure.cost import STEP_INPUTS_S, DeviceRates, PointWork
from moebench.registry import Case, CheckResult, RunContext, declare_work, register_impl


def trace_capacities(p: Params, device: torch.device) -> tuple[list[int], list[int], list[int]]:
    """(batch sizes, capacities, rows sent) per step of the point's trace, as jit_trace.a2a_fixed computes them."""
    from moebench.bench.jit_trace import step_inputs, trace_batch_sizes
    from moebench.dispatch.pack import CapacityKnobs, capacity_for

    sizes = trace_batch_sizes(p)
    capacities, sent = [], []
    for i, batch in enumerate(sizes):
        step = step_inputs(p, i, batch, device)
        cap = p.knobs(CapacityKnobs)
        capacities.append(capacity_for(cap.capacity_policy, step["max_rows"], cap.num_max_tokens_per_rank))
        sent.append(int(step["counts"].sum().item()))
    return sizes, capacities, sent


def _validate(p: Params) -> str | None:
    """jit_trace.a2a_fixed's limits: the same trace must fit the same buffer."""
    from moebench.bench.jit_trace import validate_trace

    return validate_trace(p)


@register_impl("jit_trace.a2a_fixed_wire", targets=("jit_trace",), validate=_validate,
               description="the trace's a2a_fixed wire traffic under capacity_policy: one device copy of ep_size "
                           "x capacity wire rows per step (the loopback all-to-all; a lower bound of the transfer)")
def build(p: Params, ctx: RunContext) -> Case:
    from moebench.dispatch.pack import CapacityKnobs
    from moebench.dispatch.permute import RowLayout

    dev = ctx.device
    sizes, capacities, sent = trace_capacities(p, dev)
    row_bytes = RowLayout(p.hidden, p.top_k).row_bytes
    R = p.ep_size
    src = torch.randint(0, 256, (R * max(capacities), row_bytes), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    views = [(dst[:R * c], src[:R * c]) for c in capacities]

    def run():
        for d, s in views:
            d.copy_(s)

    def check() -> CheckResult:
        dst.zero_()
        run()
        n = R * max(capacities)
        ok = bool(torch.equal(dst[:n], src[:n]))
        return CheckResult(ok, "" if ok else "wire copy differs from its source", {})

    wire_rows = sum(R * c for c in capacities)
    sent_rows = sum(sent)
    info = {"policy": p.knobs(CapacityKnobs).capacity_policy, "trace_steps": len(sizes), "row_bytes": row_bytes,
            "wire_rows": wire_rows,
            "sent_rows": sent_rows, "wire_overhead": wire_rows / sent_rows if sent_rows else None,
            "wire_bytes": wire_rows * row_bytes, "mean_capacity": sum(capacities) / len(capacities),
            "distinct_capacities": len(set(capacities))}
    return Case(run=run, check=check, bytes_moved=2 * wire_rows * row_bytes,
                bytes_note="every step's ep_size x capacity wire rows read and written once (the whole trace)",
                info=info, nvtx_stage="wire")


def _wire_work(p: Params) -> tuple[float, float]:
    """Every step's ep_size blocks of wire rows copied once (at most the buffer's capacity each)."""
    from moebench.bench.jit_trace import trace_batch_sizes
    from moebench.dispatch.pack import CapacityKnobs
    from moebench.dispatch.permute import RowLayout

    sizes = trace_batch_sizes(p)
    rows = sum(min(b * p.top_k, p.knobs(CapacityKnobs).num_max_tokens_per_rank) for b in sizes) * p.ep_size
    return 0.0, 2.0 * rows * RowLayout(p.hidden, p.top_k).row_bytes


def _steps(p: Params) -> int:
    from moebench.bench.jit_trace import trace_batch_sizes

    return len(trace_batch_sizes(p))


def _capacities_s(p: Params, rates: DeviceRates) -> float:
    """Building the point: each step's batch built and routed for its capacity."""
    return _steps(p) * STEP_INPUTS_S


# the timed call copies the whole trace's wire rows, one copy per step
declare_work("jit_trace.a2a_fixed_wire", PointWork(call=_wire_work, launches=_steps, build=_capacities_s,
                                                   torch_variants=("a2a_fixed_wire",)))
