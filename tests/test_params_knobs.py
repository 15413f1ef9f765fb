"""Params: the core and the knob groups families declare beside themselves (moebench.params.register_knobs).

A group's keys are sweep keys and flat Params keys, read through p.knobs(Group); the loader checks them by the
group's own problem(); a new group leaves every recorded point key as it was."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from moebench import params as params_module
from moebench.params import Params, Point, register_knobs
from moebench.run.sweep import SweepError, knob_groups, param_names, sweep_from_dict

REPO = Path(__file__).resolve().parent.parent


def test_every_committed_record_keeps_its_key_and_its_params():
    """Each record under results/ rebuilt from its flat params has its recorded key, and the same params back."""
    knob_groups()  # every family's group registered
    checked = 0
    for path in sorted(REPO.glob("results/**/records.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            rec = json.loads(line)
            if "key" not in rec:
                continue
            p = Params(**rec["params"])
            assert Point(0, rec["impl"], p).key == rec["key"], f"{path}:{n}"
            flat = p.to_dict()
            assert {k: flat[k] for k in rec["params"]} == rec["params"], f"{path}:{n}"
            checked += 1
    assert checked > 1000


def test_family_keys_go_to_their_groups_and_read_back_through_knobs():
    from moebench.dispatch.pack import CapacityKnobs
    from moebench.bench.serving_trace.knobs import ServingKnobs
    from moebench.traces.knobs import TraceKnobs

    p = Params(num_tokens=8, trace_steps=5, dp_size=2, capacity_policy="pow2")
    assert p.knobs(TraceKnobs).trace_steps == 5 and p.knobs(ServingKnobs).dp_size == 2
    assert p.knobs(CapacityKnobs).capacity_policy == "pow2"
    assert not hasattr(p, "trace_steps")  # one way to read a family's key: through its group
    q = replace(p, trace_steps=100, dp_size=1, capacity_policy="exact")  # back to the defaults
    assert q == Params(num_tokens=8) and q.groups == ()
    flat = p.to_dict()
    assert flat["trace_steps"] == 5 and flat["num_tokens"] == 8 and "groups" not in flat
    assert set(flat) == set(param_names())
    with pytest.raises(TypeError, match="unknown parameter 'no_such_key'"):
        Params(no_such_key=1)


@pytest.fixture
def own_registry(monkeypatch):
    """register_knobs into copies of the registry, so a test's group is gone after it."""
    monkeypatch.setattr(params_module, "_KNOB_GROUPS", list(params_module._KNOB_GROUPS))
    monkeypatch.setattr(params_module, "_KNOB_OWNER", dict(params_module._KNOB_OWNER))


def test_a_new_group_is_a_sweep_key_checked_by_its_problem_and_keeps_the_keys(own_registry):
    knob_groups()
    before = Point(0, "topk_softmax.torch", Params(num_tokens=8)).key

    @register_knobs
    @dataclass(frozen=True)
    class ToyKnobs:
        toy_depth: int = 1

        def problem(self, p):
            return f"toy_depth: must be >= 1, got {self.toy_depth}" if self.toy_depth < 1 else None

    raw = {"name": "t", "target": "router", "impls": ["topk_softmax.torch"],
           "fixed": {"num_tokens": 8, "num_experts": 8, "top_k": 2, "hidden": 32}, "axes": {"toy_depth": [1, 3]}}
    sweep = sweep_from_dict(raw)
    assert sweep.axes["toy_depth"] == [1, 3]
    assert Point(0, "topk_softmax.torch", Params(num_tokens=8)).key == before  # at its default: not in the key
    assert Point(0, "topk_softmax.torch", Params(num_tokens=8, toy_depth=3)).key != before
    with pytest.raises(SweepError, match=r"axes\.toy_depth: must be >= 1, got 0"):
        sweep_from_dict({**raw, "axes": {"toy_depth": [0]}})
    with pytest.raises(SweepError, match=r"fixed\.toy_depth: expected int"):
        sweep_from_dict({**raw, "axes": {}, "fixed": {**raw["fixed"], "toy_depth": "deep"}})


def test_a_group_cannot_take_a_key_already_declared(own_registry):
    @dataclass(frozen=True)
    class Clash:
        num_tokens: int = 1

    with pytest.raises(ValueError, match="'num_tokens' is already Params's"):
        register_knobs(Clash)


def test_the_run_table_sizes_a_family_key_column_from_the_points():
    import io

    from moebench.report.table import Table

    knob_groups()
    table = Table(["trace_steps"], out=io.StringIO(), points=[Point(0, "x.y", Params(trace_steps=123456789012))])
    assert table.widths["trace_steps"] == len("123456789012") + 1


def test_the_header_marks_the_drawn_trace_keys_a_given_trace_supersedes():
    from moebench.traces.knobs import TraceKnobs

    fixed = {"trace_steps": 1000, "trace_distribution": "chat", "trace": [3, 5, 1], "top_k": 2}
    assert set(TraceKnobs.unused(fixed)) == {"trace_steps", "trace_distribution"}
    assert set(TraceKnobs.unused({**fixed, "trace_file": "t.csv"})) == {"trace_steps", "trace_distribution", "trace"}
    assert TraceKnobs.unused({"trace_steps": 10, "trace_distribution": "chat"}) == {}
