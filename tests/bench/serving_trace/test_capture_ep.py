"""The capture-list search priced by the EP step (serving_trace.capture_ep) at the scenario's cpu size: each list's
EP figure is the same whichever way it is composed (a named list's own steps, or read off the priced table),
padding_tax on a list the search found gives the same EP step (the rank workloads shared through the run's store,
every one timed), and a point without EP ranks, or with too many (step, size) pairs, says why it is not priced."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from moebench.bench import capture_search, serving_trace
from moebench.bench.serving_trace import capture_ep
from moebench.bench.serving_trace.trace_input import trace_tokens
from moebench.registry import RunContext
from moebench.report.capture_search import ep_headline, table_lines
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[3]
# every rank workload of the scenario's cpu size timed (26 of them), so padding_tax's EP step reads the same times
EVERY_RANK = ["timing.iters=1", "timing.warmup=0", "timing.unroll=1", "ep_rank_timings=64"]


def _point(overrides=EVERY_RANK):
    (point,) = expand(load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml", overrides, size="cpu"))
    return point


def test_the_ep_search_agrees_with_padding_tax_and_with_each_lists_own_steps():
    point = _point()
    ctx = RunContext(device=torch.device("cpu"))
    info = capture_search.build(point.params, ctx).info
    ep = info["capture_search"]["ep_step"]
    assert ep["rank_times"] == "timed" and ep["pairs"] == 10
    named = ep["named"]
    for side in ("masked", "oblivious"):
        s = ep["sides"][side]
        # `dense` pads every step to its own maximum, as capturing every candidate does: its steps composed under
        # dense and the table's diagonal give one figure
        assert named["dense"][side]["time_us"] == pytest.approx(s["lower_bound_us"], rel=1e-9, abs=2e-3)
        for k, row in s["per_k"].items():
            assert row["searched_us"] == pytest.approx(row["figures"][side]["time_us"], rel=1e-9, abs=2e-3)
        row = s["per_k"]["2"]
        p = dataclasses.replace(capture_search._layer_params(point.params), capture_sizes=row["sizes"])
        tax = serving_trace.build(p, ctx).info["ep_step"]
        assert tax["rank_timings"] == 0  # every workload read from the search's timings
        # padding_tax's EP step over the same list is the search's figure without the eager launches
        assert tax["totals"][side]["step_us"] == pytest.approx(row["figures"][side]["ep_step_us"], rel=1e-9)
    # masked padded rows route nowhere: without SP or DBO every list's masked EP step is the same, to the bit
    assert len({v["masked"]["ep_step_us"] for v in named.values()}) == 1
    # the oblivious side does other work where a list pads (its time, in the interpreter's one-sample timings, may
    # fall either way), and the same where it does not: `dense` pads no step with both DP ranks alike
    assert named["default"]["oblivious"]["ep_step_us"] != named["default"]["masked"]["ep_step_us"]
    lines = table_lines(info)
    assert any(line.startswith("the EP step over the trace (the slowest of 2 EP ranks") for line in lines)
    assert ep_headline(info).startswith("EP step: ") and "every rank workload timed" in ep_headline(info)
    # each headline names the lists it counts (the curve's lists are recorded, whatever K the run asked for)
    import re

    from moebench.report.capture_search import headline

    found = r"(\d+ graphs? \[[\d,]+\]|more than \d+)"  # (the interpreter's one-sample timings may never reach fine)
    for text in (headline(info), ep_headline(info)):
        assert re.search(found + r" chosen (for this trace )?cost what `fine`'s 51 cost; masked, " + found, text), text
    # the masked EP step is one figure under every list: one graph costs what fine's do
    assert re.search(r"masked, 1 graph \[\d+\];", ep_headline(info)), ep_headline(info)
    assert all(len(sizes) <= k + 1 for k, sizes in enumerate(ep["sides"]["oblivious"]["curve_lists"]))
    # the report's notes carry the same table and headlines as the terminal
    from types import SimpleNamespace

    from moebench.report.page import notes

    record = {"impl": "serving_trace.capture_search", "status": "ok", "point": 0, "info": info,
              "params": point.params.to_dict(), "target": "serving_trace"}
    page = notes(SimpleNamespace(records=[record]))
    assert set(lines) <= set(page)
    # with EP ranks the EP step's answer comes first: it is what the deployment waits for
    assert page.index(f"headline: {ep_headline(info)}") < page.index(f"headline: {headline(info)}")


def test_the_priced_table_reads_each_list_as_its_steps_compose():
    point = _point(["timing.iters=1", "timing.warmup=0", "timing.unroll=1"])
    p = capture_search._layer_params(point.params)
    trace, _ = trace_tokens(p)
    engine = capture_search._engine(p)
    steps = trace.table()
    cands = capture_search.candidate_sizes(steps, engine)
    lists = {"low": [int(cands[0])], "mid": [int(c) for c in cands[1:3]], "all": [int(c) for c in cands]}
    clock = serving_trace.record.PhaseClock()
    ep = capture_ep.price_ep(p, torch.device("cpu"), serving_trace.SHAPE_TIMING["cpu"], steps, trace.counts,
                             engine, (), lists, {"masked": 7.0, "oblivious": 5.0}, clock)
    assert ep.virtual_steps == ep.pairs + (1 + len(lists)) * len(steps)
    for side in ("masked", "oblivious"):
        for name, sizes in lists.items():
            read = ep.chosen_figures(side, sizes)
            own = ep.named[name][side]
            for key in ("time_us", "ep_step_us", "eager_launch_us"):
                assert read[key] == pytest.approx(own[key], rel=1e-12, abs=1e-6), (side, name, key)
        # steps above the list's largest size pay one source's launches, not every DP rank's
        low = ep.named["low"][side]
        above = int((trace.counts * (steps.max(axis=1) > cands[0])).sum())
        assert low["eager_launch_us"] == pytest.approx(above * {"masked": 7.0, "oblivious": 5.0}[side])
        assert ep.named["all"][side]["eager_launch_us"] == 0.0


def test_a_point_without_ep_ranks_or_with_too_many_pairs_says_why_it_is_not_priced(monkeypatch):
    p = capture_search._layer_params(_point().params)
    engine = capture_search._engine(p)
    steps = trace_tokens(p)[0].table()
    assert capture_ep.not_priced_reason(p, steps, engine) is None
    one = dataclasses.replace(p, ep_size=1)
    assert capture_ep.not_priced_reason(one, steps, engine) == "no EP ranks (ep_size 1): the layer is the step"
    monkeypatch.setattr(capture_ep, "EP_PAIRS_MAX", 9)
    assert capture_ep.not_priced_reason(p, steps, engine) == (
        "10 (step, candidate) pairs past 9: the EP step is not priced, the layer is")
    assert np.asarray(steps).shape[1] == 2


def test_the_estimate_counts_the_ep_steps_pricing(monkeypatch):
    from moebench.measure.cost import DeviceRates

    p = _point().params
    rates = DeviceRates("interpreter")
    priced = capture_search.search_seconds(p, rates)
    assert capture_search.search_work(p, "cpu")["ep_virtual_steps"] == 10 + 6 * 4  # pairs, eager and 5 named lists
    monkeypatch.setattr(capture_ep, "EP_PAIRS_MAX", 9)  # the EP step no longer priced: its timings no longer counted
    assert capture_search.search_work(p, "cpu")["ep_virtual_steps"] == 0
    assert capture_search.search_seconds(p, rates) < priced - 1.0
