"""A trace's per-step latency: the distribution of a step's time over the trace's steps (each distinct step as often
as it occurs), stated per side in the headline beside the totals, and read back through the typed record."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from moebench.bench.serving_trace.record import TraceHeadline
from moebench.bench.serving_trace.steps import step_percentiles
from moebench.params import Params
from moebench.registry import RunContext, get


def test_percentiles_count_each_distinct_step_as_often_as_it_occurs():
    # 98 steps of 1 us, one of 5 us, one of 9 us: p50 1, p99 5 (the 99th of 100), max 9
    got = step_percentiles(np.asarray([9.0, 1.0, 5.0]), [1, 98, 1])
    assert got == {"p50": 1.0, "p99": 5.0, "max": 9.0}
    assert step_percentiles(np.asarray([2.0, 7.0]), [1, 1]) == {"p50": 2.0, "p99": 7.0, "max": 7.0}


def test_the_headline_states_a_steps_time_distribution_per_side():
    p = replace(Params(), num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16,
                ep_size=2, dp_size=2, trace=[3, 5, 3, 1], capture_sizes=[4, 8])
    info = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu"))).info
    head = TraceHeadline.from_info(info["headline"])
    steps = info["trace_steps"]
    for side in ("masked", "oblivious"):
        per_step = [s["layer_us"][side] for s in steps]
        assert head.step_percentiles_us[side]["max"] == max(per_step)
        assert min(per_step) <= head.step_percentiles_us[side]["p50"] <= max(per_step)
        ep = [s["ep_step_us"][side] for s in steps]
        assert head.ep_step.step_percentiles_us[side]["max"] == max(ep)
    assert TraceHeadline.from_info(head.to_info()) == head


def test_a_long_trace_checks_an_even_sample_with_its_first_and_last_steps():
    from moebench.bench.serving_trace.step_calls import check_sample

    assert check_sample(5).tolist() == [0, 1, 2, 3, 4]
    got = check_sample(1_000_000, limit=100)
    assert len(got) == 100 and got[0] == 0 and got[-1] == 999_999 and (np.diff(got) > 0).all()


def test_capture_searchs_command_leaves_the_budgets_to_the_sweep_unless_given():
    from argparse import Namespace

    from moebench.run.capture_search import capture_search_sweep

    args = Namespace(trace="chat", model="deepseek-v3", ep_size=1, dp_size=1, sp_size=1, dbo=False, fill="repeat",
                     seed=0, graphs=None, steps=10, max_tokens=64, largest=None, keep=None, shape_timings=None,
                     set=None)
    assert "capture_graphs" not in capture_search_sweep(args)["fixed"]  # the sweep's 1, 2, 4, ... up to the sizes
    args.graphs = [2, 4]
    assert capture_search_sweep(args)["fixed"]["capture_graphs"] == [2, 4]
