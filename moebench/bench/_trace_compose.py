"""Composing a serving trace from its distinct shapes, and replaying it step by step; pure arithmetic.

The trace's GPU time is a sum over its steps' MoE-layer calls (every DP rank, micro-batch and SP rank: the calls
of moebench.inputs.engine_padding.step_padding) of the layer time of the call's shape (rows, real). `compose`
looks each call up in a table measured once per distinct shape; `replay` asks a timer for every call in step
order, with no cache (how the composition is checked: on a GPU against real re-timing, in the tests against the
same timer, where the two must agree exactly). Per call and side the time on padded rows is the call's time minus
the time of its real tokens alone (the same side's layer at the shape (real, real)): 0 for an unpadded call.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from moebench.inputs.engine_padding import StepPadding

SIDES = ("masked", "oblivious")
ShapeTimer = Callable[[str, int, int], float]  # (side, rows, real) -> microseconds


def distinct_shapes(paddings: Sequence[StepPadding]) -> list[tuple[int, int]]:
    """The shapes to measure, sorted: every call's (rows, real), and its real tokens alone (real, real)."""
    shapes = set()
    for step in paddings:
        for call in step.calls:
            shapes.add((call.rows, call.real))
            if call.real:
                shapes.add((call.real, call.real))
    return sorted(shapes)


def _step_times(step: StepPadding, time_of: ShapeTimer) -> dict[str, dict[str, float]]:
    out = {"layer_us": {}, "real_only_us": {}}
    for side in SIDES:
        out["layer_us"][side] = sum(time_of(side, c.rows, c.real) for c in step.calls)
        out["real_only_us"][side] = sum(time_of(side, c.real, c.real) for c in step.calls if c.real)
    return out


def compose(paddings: Sequence[StepPadding], table: Mapping[tuple[str, int, int], float]
            ) -> list[dict[str, dict[str, float]]]:
    """Per step {layer_us: {side: us}, real_only_us: {side: us}} from `table[(side, rows, real)]`."""
    return [_step_times(step, lambda side, rows, real: table[(side, rows, real)]) for step in paddings]


def replay(paddings: Sequence[StepPadding], time_call: ShapeTimer) -> list[dict[str, dict[str, float]]]:
    """The same figures with `time_call` asked for every call of every step, in order (no cache)."""
    return [_step_times(step, time_call) for step in paddings]


def totals(per_step: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Sums over the steps: {layer_us: {side}, real_only_us: {side}, padding_us: {side}}."""
    out = {what: {side: sum(s[what][side] for s in per_step) for side in SIDES}
           for what in ("layer_us", "real_only_us")}
    out["padding_us"] = {side: out["layer_us"][side] - out["real_only_us"][side] for side in SIDES}
    return out


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def headline(tot: dict[str, dict[str, float]]) -> dict[str, object]:
    """The run's headline figures from the trace totals: the padding tax per side (time on padded rows over the
    layer's time), and what the masks recover (oblivious minus masked time, absolute and as a share of the
    oblivious padding time)."""
    layer, padding = tot["layer_us"], tot["padding_us"]
    recovered = layer["oblivious"] - layer["masked"]
    return {"layer_us": dict(layer), "real_only_us": dict(tot["real_only_us"]), "padding_us": dict(padding),
            "padding_tax": {side: share(padding[side], layer[side]) for side in SIDES},
            "recovered_us": recovered, "recovered_share": share(recovered, padding["oblivious"])}
