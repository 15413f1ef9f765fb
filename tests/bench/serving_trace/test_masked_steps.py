"""One figure per masked EP step in a run (serving_trace.masked_steps): the store's sharing rule, and padding_tax over
several capture lists in one run giving one masked EP step (padded rows route nowhere: the lists do the same
masked work), while the oblivious side still pays for each list's padding."""

import dataclasses
from pathlib import Path

import numpy as np
import torch

from moebench.bench import capture_search, serving_trace
from moebench.bench.serving_trace.masked_steps import MaskedStepStore, shares_masked_steps
from moebench.registry import RunContext
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[3]


def test_the_first_figures_of_a_steps_real_tokens_are_the_runs():
    store = MaskedStepStore().for_config(("a",))
    real = np.array([[3, 2], [5, 5], [3, 2], [7, 1]])
    cols = {"step_us": np.array([10.0, 20.0, 11.0, 30.0]), "slowest_rank": np.array([0, 1, 1, 0])}
    assert store.share(real, cols) == 0
    # a repeat within one call takes the first occurrence's figures
    assert cols["step_us"].tolist() == [10.0, 20.0, 10.0, 30.0] and cols["slowest_rank"].tolist() == [0, 1, 0, 0]
    later = {"step_us": np.array([99.0, 40.0, 98.0]), "slowest_rank": np.array([5, 5, 5])}
    assert store.share(np.array([[5, 5], [9, 9], [3, 2]]), later) == 2
    assert later["step_us"].tolist() == [20.0, 40.0, 10.0] and later["slowest_rank"].tolist() == [1, 5, 0]
    assert len(store) == 4
    assert len(store.for_config(("b",))) == 0  # another configuration starts afresh


def test_padding_tax_over_several_lists_gives_one_masked_ep_step():
    (point,) = expand(load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml",
                                 ["timing.iters=1", "timing.warmup=0", "timing.unroll=1", "ep_rank_timings=6"],
                                 size="cpu"))
    base = capture_search._layer_params(point.params)
    assert shares_masked_steps(base) and base.ep_size == 2
    ctx = RunContext(device=torch.device("cpu"))
    ep = {}
    for sizes in ([2, 3, 5, 7], [7], [4, 8], "dense"):
        info = serving_trace.build(dataclasses.replace(base, capture_sizes=sizes), ctx).info
        ep[str(sizes)] = info["ep_step"]
    # the rank model is a model (6 of its workloads timed), refitted at each point: the store, not the model, makes
    # the lists agree, to the bit
    assert {e["rank_times"] for e in ep.values()} == {"model"}
    masked = {k: e["totals"]["masked"]["step_us"] for k, e in ep.items()}
    assert len(set(masked.values())) == 1, masked
    assert [e["masked_steps_shared"] for e in ep.values()] == [0, 4, 4, 4]  # the trace's 4 distinct steps
    obl = {k: e["totals"]["oblivious"]["step_us"] for k, e in ep.items()}
    assert ep["[4, 8]"]["tax"]["total_us"] != 0  # padded up: the oblivious side does other work
    # both DP ranks hold the same tokens: every step at its own size pads nothing, and the oblivious side is the
    # masked one (no tax), as under `dense`
    for key in ("[2, 3, 5, 7]", "dense"):
        assert obl[key] == masked[key] and ep[key]["tax"]["total_us"] == 0
