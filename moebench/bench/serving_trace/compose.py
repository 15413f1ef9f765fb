"""Composing a serving trace from its distinct shapes, and replaying it step by step; pure arithmetic.

The trace's GPU time is a sum over its steps' MoE-layer calls (every DP rank, micro-batch and SP rank: the calls
of moebench.inputs.engine_padding.step_padding) of the layer time of the call's shape (rows, real). `compose`
looks each call up in a table of timings (or an interpolating lookup over one), step by step (a long trace's
distinct steps are composed over arrays: steps.StepFigures; replay.replay_calls asks a timer for every call in step
order, with no cache, what the composition is checked against). Per call and side the time on padded rows is the
call's time minus the time of its real tokens alone (the same side's layer at the shape (real, real)): 0 for an
unpadded call.

Two ways to fill the table (the sweep's trace_real_points, N):
  exact         (N = 0) every distinct shape timed: `distinct_shapes`
  interpolated  (N > 0) `interpolation_shapes`: the real-tokens-alone curve t(n) = time(n, n) at every distinct
                `rows` (mostly free: (rows, rows) is a call's shape) plus the powers of two up to the largest real
                count (the curve's small-n end is latency-bound and flat, its large-n end linear: a geometric grid
                keeps the piecewise-linear error small at both); and for each padded row count `rows` that has a
                padded call, the layer at the real counts of `real_grid(rows, N)`. A padded call is read as its
                real tokens alone plus what its padding adds: time(rows, real) = t(real) + d(rows, real), with
                d(rows, r) = time(rows, r) - t(r) measured at the grid points and linear in r between them. The
                padding's part is the smooth one (masked: the router and the masked rows' bookkeeping; oblivious:
                the padded rows' routes too; 0 real tokens is a shape of its own, see real_grid); the concave
                part (how many experts, hence weight bytes, the real tokens reach) is the curve's, sampled
                densely. Interpolating time(rows, .) itself between N + 1 points cut through that concavity: on
                the H200 it put the composed trace 3.5% under the replayed one and the masked padding tax at -4%.
                Of all samples only those some call reads are timed (its grid neighbours, and the curve's
                neighbours of its real count and of those grid points).
                `interpolated_timer` reads the table back as a ShapeTimer, exact at the samples (so an unpadded
                call, rows == real, is always its own measurement). The timing count scales with distinct padded
                row counts, not with distinct real-token counts.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Callable, Mapping, Sequence

from moebench.bench.serving_trace.record import SIDES
from moebench.inputs.engine_padding import StepPadding

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


def padded_row_counts(paddings: Sequence[StepPadding]) -> list[int]:
    """The distinct `rows` of the trace's calls, sorted."""
    return sorted({c.rows for step in paddings for c in step.calls})


def real_grid(rows: int, real_points: int) -> list[int]:
    """The real counts a padded row count is timed at: round(rows * j / N) for j in 0..N (0 and rows included),
    and 1: a call with no real token (an idle DP rank) is a shape of its own, it pays the layer's fixed cost on
    padding alone, so the added time of calls with real tokens is interpolated from 1 up, never across 0."""
    return sorted({round(rows * j / real_points) for j in range(real_points + 1)} | {min(1, rows)})


def _grid_of(rows: int, real: int, real_points: int) -> list[int]:
    """The grid points a call (rows, real) reads from: 0 alone for real = 0, the positive ones otherwise."""
    grid = real_grid(rows, real_points)
    return [0] if real == 0 else [r for r in grid if r > 0]


def real_only_points(paddings: Sequence[StepPadding]) -> list[int]:
    """Where the real-tokens-alone curve is sampled: every distinct rows, and 1, 2, 4, ... up to the largest real."""
    points = set(padded_row_counts(paddings))
    top = max((c.real for step in paddings for c in step.calls), default=0)
    n = 1
    while n <= top:
        points.add(n)
        n *= 2
    return sorted(points)


def _bracket(xs: Sequence[int], x: int) -> tuple[int, int]:
    """The neighbouring samples of x in sorted xs, (x, x) at a sample; x must lie within [xs[0], xs[-1]]."""
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return x, x
    if i == 0 or i == len(xs):
        raise KeyError(f"{x} outside the samples [{xs[0]}, {xs[-1]}]")
    return xs[i - 1], xs[i]


def interpolation_shapes(paddings: Sequence[StepPadding], real_points: int) -> list[tuple[int, int]]:
    """The shapes interpolated mode times, sorted: of each padded row count's grid and of the real-only curve's
    samples, the points some call's interpolation reads (the others would cost timings and change no figure)."""
    if real_points < 1:
        raise ValueError(f"interpolation_shapes: real_points must be >= 1, got {real_points}")
    curve = real_only_points(paddings)
    shapes = set()

    def curve_at(n: int) -> None:  # t(n) reads the curve's neighbours of n; t(0) = 0 is no timing
        if n:
            shapes.update((m, m) for m in _bracket(curve, n))

    for step in paddings:
        for c in step.calls:
            if c.real < c.rows:
                for r in _bracket(_grid_of(c.rows, c.real, real_points), c.real):
                    shapes.add((c.rows, r))
                    curve_at(r)
            else:
                shapes.add((c.rows, c.rows))
            curve_at(c.real)
    return sorted(shapes)


def interpolated_timer(table: Mapping[tuple[str, int, int], float], real_points: int) -> ShapeTimer:
    """A ShapeTimer from the timings of interpolation_shapes. (n, n): linear in n between its neighbours among the
    table's (n, n) samples (the curve's points that were read: no sample of the curve lies between two read
    neighbours), t(0) = 0. (rows, real) with real < rows: t(real) + d, d linear in real between its neighbours r
    on real_grid(rows, N) (its positive points for real > 0), where d(rows, r) = table[(rows, r)] - t(r)."""
    curve = {side: sorted(n for (s, n, r) in table if s == side and n == r) for side in SIDES}

    def linear(x: int, lo: int, hi: int, at: Callable[[int], float]) -> float:
        return at(x) if lo == hi else at(lo) + (at(hi) - at(lo)) * (x - lo) / (hi - lo)

    def real_only(side: str, n: int) -> float:
        return linear(n, *_bracket(curve[side], n), lambda m: table[(side, m, m)]) if n else 0.0

    def time_of(side: str, rows: int, real: int) -> float:
        if rows == real:
            return real_only(side, real)
        added = linear(real, *_bracket(_grid_of(rows, real, real_points), real),
                       lambda r: table[(side, rows, r)] - real_only(side, r))
        return real_only(side, real) + added
    return time_of


def step_times(step: StepPadding, time_of: ShapeTimer) -> dict[str, dict[str, float]]:
    out = {"layer_us": {}, "real_only_us": {}}
    for side in SIDES:
        out["layer_us"][side] = sum(time_of(side, c.rows, c.real) for c in step.calls)
        out["real_only_us"][side] = sum(time_of(side, c.real, c.real) for c in step.calls if c.real)
    return out


def compose(paddings: Sequence[StepPadding], table: Mapping[tuple[str, int, int], float] | ShapeTimer
            ) -> list[dict[str, dict[str, float]]]:
    """Per step {layer_us: {side: us}, real_only_us: {side: us}} from `table[(side, rows, real)]` (exact mode), or
    from a lookup such as interpolated_timer's."""
    time_of = table if callable(table) else (lambda side, rows, real: table[(side, rows, real)])
    return [step_times(step, time_of) for step in paddings]


def layer_totals(per_step: Sequence[dict[str, dict[str, float]]], counts: Sequence[int] | None = None
           ) -> dict[str, dict[str, float]]:
    """Sums over the steps, each weighted by its count when given (a distinct step standing for `count` steps):
    {layer_us: {side}, real_only_us: {side}, padding_us: {side}}."""
    counts = counts if counts is not None else [1] * len(per_step)
    # fsum: the exact sum whatever the order (steps.StepFigures sums the same products over arrays)
    out = {what: {side: math.fsum(n * s[what][side] for s, n in zip(per_step, counts)) for side in SIDES}
           for what in ("layer_us", "real_only_us")}
    out["padding_us"] = {side: out["layer_us"][side] - out["real_only_us"][side] for side in SIDES}
    return out
