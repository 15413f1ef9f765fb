"""The contract every registered impl keeps, checked for all of them at once (a new impl gets these tests for free):
at a small point on the CPU it builds, its check passes, it declares the bytes (or FLOPs) it must move, it times
through moebench.measure.timing, and its NVTX range is `moebench/<stage>/<impl>`.

The point is the sweep defaults (moebench.params.Params) shrunk to interpreter sizes, with a per-family override
where a family needs its own knobs (ep_sim: simulated ranks; jit_trace: a short batch-size trace). Multi-rank impls
(dispatch paths) are built at ep_size 1, which every path supports; an impl that cannot run here (available(ctx)
gives a reason, e.g. deep_ep not installed, CUDA only) is skipped with that reason.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moebench import registry
from moebench.measure.timing import measure
from moebench.measure.nvtx import range_name
from moebench.params import Params, Timing
from moebench.registry import RunContext

CPU = RunContext(device=torch.device("cpu"))

# The sweep defaults (a DeepSeek-V3-like layer) shrunk to what Triton's interpreter runs in well under a second.
SMALL = dict(num_tokens=16, num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
             padding_ratio=0.25, num_max_tokens_per_rank=16)
FAMILY_OVERRIDES = {
    "ep_sim": dict(ep_mode="simulated", ep_size=2),  # its validate accepts simulated points only
    "jit_trace": dict(hidden=32, trace=[5, 17, 5, 40], num_max_tokens_per_rank=48, padding_ratio=0.0),
    "serving_trace": dict(trace=[3, 6], capture_sizes=[4, 8]),  # 4 distinct shapes
}
# fp8 expert impls need 128x128 weight blocks
IMPL_PREFIX_OVERRIDES = {"fused_experts.fp8": dict(hidden=128, intermediate=128, group_size=32)}
TIMING = Timing(mode="wall", warmup=0, iters=1, max_seconds=60.0)
RANGE = re.compile(r"moebench/[a-z0-9_]+/[a-z0-9_]+\.[a-z0-9_]+")


def small_params(impl: registry.Impl) -> Params:
    over = {**SMALL, **FAMILY_OVERRIDES.get(impl.kernel, {})}
    for prefix, extra in IMPL_PREFIX_OVERRIDES.items():
        if impl.name.startswith(prefix):
            over.update(extra)
    p = dataclasses.replace(Params(), **over)
    if impl.multi_rank:
        p = dataclasses.replace(p, ep_size=1)  # one process: the path degenerates to local compute
    return p


def skip_reason(impl: registry.Impl) -> str | None:
    """Why this impl is not exercised on the CPU here, or None."""
    why = impl.available(CPU)
    if why:
        return f"not available on CPU: {why}"
    why = impl.validate(small_params(impl))
    if why and impl.multi_rank:
        return f"multi-rank impl cannot run on a single rank: {why}"
    return None


def contract_impls() -> list[str]:
    """The collection function of the contract test: every registered impl (bench/ and peers/ modules are found by
    registry.load_all, so a new one is collected without being named)."""
    return sorted(registry.all_impls())


IMPLS = contract_impls()


@pytest.mark.parametrize("name", IMPLS)
def test_impl_keeps_the_contract(name):
    impl = registry.get(name)
    why = skip_reason(impl)
    if why:
        pytest.skip(why)
    p = small_params(impl)
    assert impl.validate(p) is None, impl.validate(p)
    case = impl.build(p, CPU)
    try:
        assert case.check is not None, "every case checks itself against its reference"
        res = case.check()
        assert res.ok, res.detail
        assert case.bytes_moved > 0 or case.flops > 0, "a case declares the work it must do"
        stage = case.nvtx_stage or impl.kernel
        rng = range_name(stage, impl.name)
        assert RANGE.fullmatch(rng) and rng == f"moebench/{stage}/{impl.name}", rng
        timed = measure(case.run, TIMING, CPU.device, graph_capturable=case.graph_capturable, range_name=rng)
        assert timed.mode == "wall" and timed.stats["n"] >= 1 and timed.stats["p50"] > 0
        for stage_name, fn in case.stages:  # the layer's stages are timed one by one as well
            assert RANGE.fullmatch(range_name(stage_name, impl.name))
            fn()
    finally:
        if case.cleanup is not None:
            case.cleanup()


def test_every_impl_available_on_cpu_is_covered(capsys):
    """Acceptance: each impl `moebench list` shows as available here runs through the contract test above."""
    from moebench.cli import cmd_list

    cmd_list(None)
    listed = capsys.readouterr().out.splitlines()
    available = {line.split()[0] for line in listed if line.startswith("  ") and len(line.split()) > 2
                 and line.split()[2] == "yes"}
    assert available, "moebench list shows no impl available on the CPU"
    # IMPLS is the registry at collection, before any test ran: every impl of the package (load_all registers them
    # at import). Impls other tests register later in this process (plugins, test-only paths) are not the
    # package's and are not held to it.
    ours = available & set(IMPLS)
    assert ours, "moebench list shows none of the package's impls available on the CPU"
    assert {n for n in ours if skip_reason(registry.get(n)) is not None} == set()


def test_declarations_pair_twins_and_name_baselines():
    """Twins are declared (twin_of names a registered mask-aware impl of the same family), never inferred from a
    name; each kernel family with a plain-torch reference names it as its baseline."""
    impls = registry.all_impls()
    for impl in impls.values():
        if impl.twin_of is not None:
            partner = impls[impl.twin_of]
            assert partner.mask_aware and partner.kernel == impl.kernel, impl.name
    baselines = {impl.kernel for impl in impls.values() if impl.baseline}
    with_torch = {impl.kernel for impl in impls.values() if impl.variant == "torch"}
    assert with_torch <= baselines
    oblivious = {impl.name for impl in impls.values() if impl.variant == "oblivious"}
    assert all(impls[n].twin_of for n in oblivious)
