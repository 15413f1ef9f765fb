"""The serving_trace target: the engine's per-step padding against the producers' own functions (exact, call by
call), trace files (bundled example, line-numbered refusals through the command line), the trace sources, and the
composition of the trace from its distinct shapes against a step-by-step replay (exact with one timer; within a
loose bound with the layer re-timed on the CPU)."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moebench.bench import serving_trace
from moebench.bench.serving_trace import headline, steps as step_figures
from moebench.bench.serving_trace.step_calls import step_calls
from moebench.bench.serving_trace.compose import (compose, distinct_shapes, interpolated_timer, interpolation_shapes,
                                                  layer_totals as totals, padded_row_counts, real_grid,
                                                  real_only_points)
from moebench.bench.serving_trace.replay import replay_calls as replay
from moebench.bench.serving_trace.record import SIDES
from moebench.bench.serving_trace.replay import REPLAY_TOLERANCE
from moebench.bench.serving_trace.shapes import ShapeBench
from moebench.cli import main
from moebench.inputs.engine_padding import Engine, producer_calls, step_padding
from moebench.inputs.padding import cudagraph_padded_size
from moebench.params import Params, Point, Timing
from moebench.traces.capture_lists import CAPTURE_LISTS, resolve_capture_sizes
from moebench.traces.csv_trace import BUNDLED_DIR, read_trace_file

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------------------------------
# Per-step padding = the producers' own functions, exactly
# ---------------------------------------------------------------------------------------------------------------

ENGINES = [Engine(tuple(resolve_capture_sizes(c)), dp, sp, dbo)
           for c, dp, sp, dbo in itertools.product(("default", "pow2", [3, 10, 24]), (1, 3), (1, 2, 4), (False, True))]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: f"caps{len(e.capture_sizes)}-dp{e.dp_size}-sp{e.sp_size}"
                                                         f"-dbo{int(e.dbo)}")
def test_step_padding_matches_the_producers(engine):
    rng = random.Random(engine.dp_size * 100 + engine.sp_size * 10 + engine.dbo)
    steps = [[rng.choice([0, 1, 2, 3, 7, 9, 23, 24, 25, 511, 512, 513, 700]) for _ in range(engine.dp_size)]
             for _ in range(12)]
    for real in steps:
        step = step_padding(real, engine)
        cg_rows, dp_rows, calls = producer_calls(real, engine)
        assert list(step.cudagraph_rows) == cg_rows == [cudagraph_padded_size(r, engine.capture_sizes) for r in real]
        assert step.dp_rows == dp_rows
        got = [(c.dp_rank, c.micro_batch, c.sp_rank, c.rows, c.real) for c in step.calls]
        assert got == calls, real
        assert sum(c[4] for c in calls) == sum(real)  # every real token in exactly one call
        assert sum(step.added_rows().values()) == step.padded_rows == sum(c[3] - c[4] for c in calls)


def test_named_capture_lists():
    assert CAPTURE_LISTS["default"] == [1, 2, 4] + list(range(8, 513, 8))
    assert CAPTURE_LISTS["pow2"] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    for name, sizes in CAPTURE_LISTS.items():
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 512, name
        assert cudagraph_padded_size(13, name) == cudagraph_padded_size(13, sizes)
    assert cudagraph_padded_size(300, "dense") == 300 and cudagraph_padded_size(600, "dense") == 600


# ---------------------------------------------------------------------------------------------------------------
# Trace sources
# ---------------------------------------------------------------------------------------------------------------

def test_bundled_example_trace_reads_and_ships():
    f = read_trace_file("example_chat_dp2.csv")
    assert f.columns == 2 and len(f.tokens) == 16 and f.tokens[0] == (12, 9) and (14, 0) in f.tokens
    assert f.per_rank(2)[3] == [140, 10]
    setup = (ROOT / "setup.py").read_text()
    assert '"moebench.traces": ["data/*.csv"]' in setup  # in the wheel
    assert (BUNDLED_DIR / "example_chat_dp2.csv").is_file()


def test_distributions_are_seeded_per_dp_rank():
    p = replace(Params(), dp_size=3, trace_steps=200, trace_max_tokens=1024, trace_distribution="chat")
    def steps(q):
        d, src = serving_trace.trace_tokens(q)
        return [d.steps[j] for j in d.index.tolist()], src

    a, _ = steps(p)
    b, _ = steps(p)
    assert a == b and len(a) == 200 and all(len(s) == 3 for s in a)
    assert all(1 <= t <= 1024 for s in a for t in s)
    ranks = list(zip(*a))
    assert ranks[0] != ranks[1]  # each DP rank its own stream
    assert sum(t <= 64 for t in ranks[0]) > 150  # decode-heavy
    for dist in ("mixed", "prefill_heavy", "uniform", "decode_prefill", "lognormal"):
        t, src = steps(replace(p, trace_distribution=dist))
        assert len(t) == 200 and src["source"] == dist and all(1 <= x <= 1024 for s in t for x in s)
    heavy, _ = steps(replace(p, trace_distribution="prefill_heavy"))
    assert sum(x == 1024 for s in heavy for x in s) > 100  # prefill chunks filling the budget


SWEEP = """\
name: t
target: serving_trace
impls: [serving_trace.layer]
fixed: {{num_experts: 8, top_k: 2, hidden: 64, intermediate: 32, group_size: 16, block_size: 16, dp_size: 2,
        trace_file: {trace}}}
timing: {{warmup: 0, iters: 1}}
"""

BAD_FILES = [
    ("not a count", "dp0,dp1\n3,4\n5,x\n", "line 3: 'x' is not a token count"),
    ("negative", "dp0,dp1\n3,-4\n", "line 2: '-4' is not a token count"),
    ("too few values", "# a comment\ndp0,dp1\n3,4\n\n5\n", "line 5: 1 values, the header has 2"),
    ("bad header", "tokens\n3\n", "line 1: header 'tokens' has no count column (num_tokens, or dp0,dp1,"),
    ("a DP rank missing", "dp0,dp2\n3,4\n", "line 1: header has dp2 but no dp1"),
    ("no steps", "dp0,dp1\n", "no steps after the header"),
    ("empty", "# nothing\n", "line 1: no header"),
    ("too large", "num_tokens\n1\n99999999\n", "line 3: 99999999 tokens, over the limit"),
    ("columns vs dp_size", "dp0,dp1,dp2\n1,2,3\n", "dp0,dp1,dp2 DP columns, but dp_size is 2"),
    ("not utf-8", b"num_tokens\n1\n\xff\n", "line 3: not UTF-8 text"),
]


@pytest.mark.parametrize("label,content,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_trace_file_is_refused_with_its_line(tmp_path, capsys, label, content, message):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(content if isinstance(content, bytes) else content.encode())
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(trace=trace))
    out, plots = tmp_path / "results", tmp_path / "plots"
    code = main(["run", str(sweep), "--out", str(out), "--plots", str(plots), "--device", "cpu"])
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1, stderr
    assert f"{sweep}: fixed.trace_file: {trace}" in err[0] and message in err[0], err[0]
    assert not out.exists() and not plots.exists() and stdout == ""


def test_an_engine_export_with_a_bom_runs_and_the_header_names_its_ignored_columns(tmp_path, capsys):
    trace = tmp_path / "export.csv"
    trace.write_bytes(b"\xef\xbb\xbfstep,timestamp,dp0,dp1\r\n0,10.5,3,4\r\n1,11.0,5,0\r\n")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(trace=trace))
    assert main(["run", str(sweep), "--dry-run"]) == 0, capsys.readouterr().err
    assert (f"trace_file = {trace}  (ignored columns, not token counts: step, timestamp)"
            in capsys.readouterr().out)


def test_missing_trace_file_and_bad_capture_list_are_refused(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(trace="no_such.csv"))
    assert main(["run", str(sweep), "--dry-run"]) == 2
    assert f"fixed.trace_file: no_such.csv: no such file beside the sweep ({tmp_path})" in capsys.readouterr().err
    sweep.write_text(SWEEP.format(trace="example_chat_dp2.csv").replace("dp_size: 2,", "dp_size: 2, "
                                                                        "capture_sizes: tiny,"))
    assert main(["run", str(sweep), "--dry-run"]) == 2
    assert "fixed.capture_sizes: unknown capture list 'tiny'" in capsys.readouterr().err


def test_engine_parameters_are_in_the_point_key():
    base = Point(0, "serving_trace.layer", Params())
    assert base.key == Point(0, "serving_trace.layer", replace(Params(), dp_size=1, dbo=False)).key
    keys = {Point(0, "serving_trace.layer", replace(Params(), **kw)).key for kw in (
        {}, {"dp_size": 2}, {"sp_size": 2}, {"dbo": True}, {"trace_file": "x.csv"}, {"trace_replay": 5},
        {"capture_sizes": "pow2"})}
    assert len(keys) == 7


# ---------------------------------------------------------------------------------------------------------------
# The composition against a step-by-step replay
# ---------------------------------------------------------------------------------------------------------------

def _paddings(engine: Engine, steps: int = 300, seed: int = 3):
    rng = random.Random(seed)
    return [step_padding([rng.choice([0, 1, 5, 17, 40, 64, 65, 300, 600]) for _ in range(engine.dp_size)], engine)
            for _ in range(steps)]


def test_composition_equals_the_replay_exactly_with_one_timer():
    """The composition sums exactly what a call-by-call replay sums: with a deterministic timer (integers, so no
    rounding) the two agree per step and in total, and the composition asks for each distinct shape once."""
    engine = Engine(tuple(CAPTURE_LISTS["default"]), dp_size=2, sp_size=2, dbo=True)
    paddings = _paddings(engine)
    asked = []

    def timer(side: str, rows: int, real: int) -> float:
        asked.append((side, rows, real))
        return 3 * rows + 7 * real + (11 if side == "oblivious" else 0) + (rows - real) ** 2

    shapes = distinct_shapes(paddings)
    table = {(side, *s): timer(side, *s) for s in shapes for side in SIDES}
    assert len(asked) == 2 * len(shapes)
    calls = sum(len(s.calls) for s in paddings)
    assert len(shapes) < calls / 4  # the point of composing: far fewer timings than calls
    asked.clear()
    composed, replayed = compose(paddings, table), replay(paddings, timer)
    assert len(asked) == 2 * sum(len(s.calls) + sum(1 for c in s.calls if c.real) for s in paddings)
    assert composed == replayed
    tot = totals(composed)
    for side in SIDES:
        assert tot["layer_us"][side] == sum(timer(side, c.rows, c.real) for s in paddings for c in s.calls)
        assert tot["padding_us"][side] == sum(timer(side, c.rows, c.real) - (timer(side, c.real, c.real)
                                              if c.real else 0) for s in paddings for c in s.calls)


def _grid_table(paddings, real_points, timer):
    return {(side, *s): timer(side, *s) for s in interpolation_shapes(paddings, real_points) for side in SIDES}


def test_real_grid():
    assert real_grid(8, 4) == [0, 1, 2, 4, 6, 8]  # 1: real tokens' added time is never read across 0
    assert real_grid(3, 8) == [0, 1, 2, 3]  # rounding merges points: a small row count is timed at every real
    assert real_grid(1, 8) == [0, 1]
    assert real_grid(1000, 8)[:4] == [0, 1, 125, 250] and real_grid(1000, 8)[-1] == 1000


def test_interpolation_is_exact_for_a_timer_linear_in_real():
    """A timer linear in real for each rows (any function of rows) and, on the diagonal, linear in n between
    the curve's samples: the interpolated composition equals the call-by-call replay with that timer."""
    engine = Engine(tuple(CAPTURE_LISTS["default"]), dp_size=2, sp_size=2, dbo=True)
    paddings = _paddings(engine)

    def timer(side: str, rows: int, real: int) -> float:
        # (rows - real) * a(rows) + real * b(rows): linear in real for fixed rows; on the diagonal b(n) * n with
        # b constant, so linear in n too
        return (rows - real) * (0.5 + rows % 7) + 3.0 * real + (2.0 if side == "oblivious" else 0.0) * rows

    time_of = interpolated_timer(_grid_table(paddings, 4, timer), 4)
    composed, replayed = totals(compose(paddings, time_of)), totals(replay(paddings, timer))
    for what in ("layer_us", "real_only_us", "padding_us"):
        for side in SIDES:
            assert composed[what][side] == pytest.approx(replayed[what][side], rel=1e-12, abs=1e-9), (what, side)


def test_grid_points_reproduce_their_measurements():
    engine = Engine(tuple(CAPTURE_LISTS["pow2"]), dp_size=2, sp_size=2)
    paddings = _paddings(engine)

    def timer(side, rows, real):
        return rows ** 1.5 + real ** 0.5 + (side == "oblivious")  # nonlinear: only the samples are exact

    table = _grid_table(paddings, 8, timer)
    time_of = interpolated_timer(table, 8)
    for (side, rows, real), us in table.items():
        assert time_of(side, rows, real) == us
    # every unpadded call (rows == real) is its own measurement, and real = 0 (an idle DP rank) a grid point
    assert all((rows, rows) in {(r, q) for (_, r, q) in table} for rows in padded_row_counts(paddings))
    assert any(real == 0 for (_, _, real) in table)
    assert {1, 2, 4, 8, 16, 32, 64, 128, 256} <= set(real_only_points(paddings))


def test_interpolated_mode_times_fewer_shapes_than_exact():
    """The scenario's trace (DeepSeek-V3 engine: DP 2, SP 2, 1000 chat steps, default capture list): the count
    of shapes timed, exact vs interpolated (the scenario's N = 8)."""
    p = replace(Params(), dp_size=2, sp_size=2, trace_distribution="chat", trace_steps=1000, trace_max_tokens=2048)
    trace, _ = serving_trace.trace_tokens(p)
    paddings = [step_padding(trace.steps[j], serving_trace.engine_of(p)) for j in trace.index.tolist()]
    exact, interpolated = distinct_shapes(paddings), interpolation_shapes(paddings, 8)
    assert len(exact) == 742 and len(interpolated) == 648  # the counts docs/scenarios.md (h) states
    assert len(padded_row_counts(paddings)) == 134
    assert len(interpolation_shapes(paddings, 2)) < len(interpolated) < len(interpolation_shapes(paddings, 16))


def test_a_nonlinear_timer_gives_a_bounded_nonzero_error():
    """Concave in real (the masked layer's expert work saturating): interpolation misses the curvature between
    grid points, by a little; a finer grid misses less."""
    engine = Engine(tuple(CAPTURE_LISTS["pow2"]), dp_size=2, sp_size=2)
    paddings = _paddings(engine)

    def timer(side, rows, real):
        return 10.0 + rows * (0.1 if side == "masked" else 1.0) + 40.0 * (real ** 0.5)

    replayed = totals(replay(paddings, timer))["layer_us"]
    errors = {}
    for n in (2, 8):
        composed = totals(compose(paddings, interpolated_timer(_grid_table(paddings, n, timer), n)))["layer_us"]
        errors[n] = {side: abs(composed[side] - replayed[side]) / replayed[side] for side in SIDES}
    for side in SIDES:
        assert 0 < errors[8][side] < errors[2][side] < 0.1, errors


def test_padding_tax_keeps_its_sign_under_a_concave_real_cost():
    """What the H200 showed: the layer's time is concave in the real tokens (the experts they reach, hence the
    weight bytes, saturate) and padding adds a little (masked: the router's rows) or more (oblivious: their
    routes). Read as real-only time plus what the padding adds, the composition keeps both: the total within 1% of
    the replay and the padding time within 10% of the true one, positive on both sides (interpolating the padded
    time itself across the concavity gave a negative masked tax)."""
    engine = Engine(tuple(CAPTURE_LISTS["default"]), dp_size=2, sp_size=2)
    paddings = _paddings(engine)

    def timer(side, rows, real):
        added = 0.02 * rows if side == "masked" else 0.02 * rows + 0.3 * (rows - real) ** 0.8
        return 20.0 + 60.0 * real ** 0.5 + added

    composed = totals(compose(paddings, interpolated_timer(_grid_table(paddings, 8, timer), 8)))
    replayed = totals(replay(paddings, timer))
    for side in SIDES:
        assert composed["layer_us"][side] == pytest.approx(replayed["layer_us"][side], rel=0.01), side
        assert replayed["padding_us"][side] > 0
        assert composed["padding_us"][side] == pytest.approx(replayed["padding_us"][side], rel=0.1), side


SMALL = dict(num_experts=8, top_k=2, hidden=64, intermediate=32, group_size=16, block_size=16, ep_size=2)


def test_composition_against_real_retiming_on_cpu():
    """The layer itself, re-timed call by call (fresh batch and pipeline each), against the composition of the
    same two steps from one timing per shape: the sums cover the same calls, so only timing noise separates them;
    under the interpreter on a shared CPU that noise is large and one-sided (other work only adds time), hence the
    best of two timings on each side and the loose bound (the H200 check is 5%)."""
    p = replace(Params(), **SMALL)
    engine = Engine((4,), dp_size=1)
    paddings = [step_padding([3], engine), step_padding([3], engine)]
    bench = ShapeBench(p, torch.device("cpu"), Timing(mode="wall", warmup=0, iters=1, max_seconds=60.0))
    shapes = distinct_shapes(paddings)
    assert shapes == [(3, 3), (4, 3)]
    table = {}
    for s in shapes:
        for _ in range(2):
            f = bench.measure_shape(*s)
            for side in SIDES:
                table[(side, *s)] = min(table.get((side, *s), float("inf")), f.layer_us[side])
    assert bench.shape_figures(4, 3).padding_gemm_rows == f.padding_gemm_rows and f.layer_us  # figures untimed

    def fresh(side: str, rows: int, real: int) -> float:
        sp, batch = bench.batch(rows, real)
        return min(bench.time_side(sp, batch, side) for _ in range(2))

    composed, replayed = totals(compose(paddings, table)), totals(replay(paddings, fresh))
    for side in SIDES:
        ratio = composed["layer_us"][side] / replayed["layer_us"][side]
        assert 1 / 3 < ratio < 3, (side, composed, replayed)


def test_build_records_the_trace(monkeypatch):
    """One small point end to end through the impl: per-step rows, distinct shapes, the headline, the check."""
    from moebench.registry import RunContext, get

    # one EP rank: every expert is local, so each padded row routed (oblivious) is top_k expert-GEMM rows
    p = replace(Params(), **{**SMALL, "ep_size": 1}, trace=[3, 5, 3], capture_sizes=[4, 8], dp_size=2,
                trace_replay=1)
    impl = get("serving_trace.layer")
    assert impl.validate(p) is None
    run = RunContext(device=torch.device("cpu"))
    case = impl.build(p, run)
    info = case.info
    # the info is the typed record, whole: nothing assembled beside it
    from moebench.bench.serving_trace.trace_record import TraceRecord
    assert TraceRecord.from_info(info).to_info() == info and info["replay"] and info["run_shape"]
    assert [s["cudagraph_rows"] for s in info["trace_steps"]] == [[4, 4], [8, 8], [4, 4]]
    assert [s["padded_rows"] for s in info["trace_steps"]] == [2, 6, 2]
    assert info["distinct_shapes"] == 4 and info["layer_calls"] == 6 and info["shapes_measured"] == 4
    h = info["headline"]
    assert h["padded_rows"] == 10 and h["real_tokens"] == 22
    assert h["padding_gemm_rows"] == {"masked": 0, "oblivious": 2 * 10}
    assert h["jit_compiles"] == {"masked": None, "oblivious": None}  # one rank: nothing dispatched
    assert info["replay"]["steps"] == 1 and info["replay"]["calls"] == 2
    assert set(info["replay"]["within_tolerance"]) == set(SIDES) and set(info["replay"]["rel_diff"]) == set(SIDES)
    assert info["replay"]["tolerance"] == REPLAY_TOLERANCE
    for key in ("composed_padding_us", "replayed_padding_us", "composed_tax", "replayed_tax"):
        assert set(info["replay"][key]) == set(SIDES), key
    assert case.check().ok
    # a second point of the same run at the same layer parameters reuses the measured shapes
    again = impl.build(replace(p, capture_sizes=[8], trace_replay=0), run)
    assert again.info["shapes_measured"] == 1 and again.info["shapes_reused"] == 3  # only (8, 3) is new
    # a new run in the same process measures again (nothing timed in an earlier run is reused)
    fresh = impl.build(replace(p, trace=[3], capture_sizes=[4], trace_replay=0),
                       RunContext(device=torch.device("cpu")))
    assert fresh.info["distinct_shapes"] == 2  # (4, 3) and (3, 3), both measured by the first run
    assert fresh.info["shapes_measured"] == 2 and fresh.info["shapes_reused"] == 0


def test_point_check_fails_when_the_step_padding_is_not_the_producers(monkeypatch):
    """The point's own check holds every step to the tensor producers: a step_padding that counts the capture
    size's padding as real tokens is caught."""
    from moebench.inputs import engine_padding
    from moebench.registry import RunContext, get

    p = replace(Params(), **{**SMALL, "ep_size": 1}, trace=[3, 5, 3], capture_sizes=[4, 8], dp_size=2)

    def padding_as_real(real, engine):
        calls = step_calls(real, engine)
        return replace(calls, real=calls.rows.copy())

    monkeypatch.setattr(serving_trace, "step_calls", padding_as_real)
    res = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu"))).check()
    assert not res.ok and "the producers make" in res.detail


def test_scenario_runs_reports_and_plots_on_cpu(tmp_path, capsys):
    """`moebench run` of the bundled scenario at small shapes, then `moebench plot` and `moebench report`: the
    padding-tax table is printed under the run and comes first in the report; the three trace figures are drawn."""
    small = ["num_experts=8", "top_k=2", "num_expert_group=1", "topk_group=1", "hidden=64", "intermediate=32",
             "group_size=16", "block_size=16", "ep_size=2", "dp_size=2", "sp_size=2", "dbo=true",
             "trace_file=example_chat_dp2.csv", "axes.capture_sizes=[pow2]", "timing.iters=1", "timing.warmup=0"]
    argv = ["run", str(ROOT / "sweeps" / "scenarios" / "padding_tax.yaml"), "--out", str(tmp_path), "--device", "cpu",
            "--no-plots"]
    for s in small:
        argv += ["--set", s]
    # the example trace has prefill steps of 140 and 520 tokens: a shorter copy keeps the interpreter quick
    short = tmp_path / "short.csv"
    short.write_text("dp0,dp1\n12,9\n14,0\n")
    argv[argv.index("trace_file=example_chat_dp2.csv")] = f"trace_file={short}"
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "# padding tax over the trace (oblivious | masked):" in stdout
    assert "fastest" not in stdout  # one capture list: nothing to rank
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("padding_tax-")]
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    kinds = {p.name.split("__")[0].removesuffix(".png") for p in (tmp_path / "plots" / run_dir.name).glob("*.png")}
    assert {"trace_tokens", "trace_cumulative", "trace_tax"} <= kinds
    report = tmp_path / "report.md"
    assert main(["report", str(run_dir), "-o", str(report)]) == 0
    text = report.read_text()
    assert text.index("### Padding tax over the trace") < text.index("- **sweep**")


def test_fp8_experts_over_a_trace():
    from moebench.registry import RunContext, get

    p = replace(Params(), num_experts=8, top_k=2, hidden=128, intermediate=128, group_size=32, block_size=16,
                expert_dtype="fp8", trace=[3], capture_sizes=[4])
    case = get("serving_trace.layer").build(p, RunContext(device=torch.device("cpu")))
    assert case.check().ok
    assert case.info["engine"]["expert_dtype"] == "fp8"
    assert case.info["headline"]["padding_gemm_rows"] == {"masked": 0, "oblivious": 2}  # one padded row, top-2


def test_ep_excess_adds_the_loads_of_calls_that_dispatch_together():
    from moebench.bench.serving_trace.shapes import ShapeFigures

    engine = Engine((4, 8), dp_size=2, dbo=True)
    step = step_padding([8, 3], engine)  # micro-batches of 4 and 4 rows on both DP ranks
    assert [(c.dp_rank, c.micro_batch, c.rows, c.real) for c in step.calls] == [
        (0, 0, 4, 4), (0, 1, 4, 4), (1, 0, 4, 3), (1, 1, 4, 0)]

    def shape(rows, real, loads):
        return ShapeFigures(rows, real, {}, {"masked": 0, "oblivious": 0}, {"masked": [0, 0], "oblivious": loads},
                            {"masked": 0, "oblivious": 0})

    figures = {(4, 4): shape(4, 4, [6, 2]), (4, 3): shape(4, 3, [0, 6]), (4, 0): shape(4, 0, [8, 0])}
    # micro-batch 0: [6, 2] + [0, 6] = [6, 8], excess 1; micro-batch 1: [6, 2] + [8, 0] = [14, 2], excess 6
    p = replace(Params(), **{**SMALL, "ep_size": 1})
    steps = step_figures.StepFigures(p, step_calls([[8, 3]], engine), figures, lambda side, rows, real: 1.0)
    assert steps.ep_excess_routes["oblivious"].tolist() == [1 + 6]


def test_interpolated_mode_keeps_the_exact_figures():
    """The same trace in both modes: every distinct shape's routing figures, every step's GEMM rows for padding,
    EP excess and capacities are identical (they are not interpolated); only the timing counts differ."""
    from moebench.registry import RunContext, get

    p = replace(Params(), **SMALL, trace=[3, 5, 7, 2], capture_sizes=[8], dp_size=2)
    impl = get("serving_trace.layer")
    exact = impl.build(p, RunContext(device=torch.device("cpu"))).info
    interp = impl.build(replace(p, trace_real_points=2), RunContext(device=torch.device("cpu"))).info
    assert exact["shape_mode"] == "exact" and interp["shape_mode"] == "interpolated"
    assert interp["trace_real_points"] == 2
    assert exact["distinct_shapes"] == interp["distinct_shapes"] == 8  # (8, r) and (r, r) for r in 2, 3, 5, 7
    assert exact["distinct_padded_shapes"] == interp["distinct_padded_shapes"] == 1  # every call has 8 rows
    assert exact["timed_shapes"] == 8
    # the grid of 8 at N = 2 is 0, 1, 4, 8 (reals 2, 3 read 1 and 4; 5, 7 read 4 and 8); the real-only curve's
    # samples 1, 2, 4, 8 (real 2 reads 2; 3 reads 2 and 4; 5, 7 read 4 and 8; the grid points 1, 4, 8 themselves)
    assert interp["timed_shapes"] == 6 and interp["shapes_measured"] == 6
    assert interp["shape_timings"] == 2 * interp["timed_shapes"]
    figures = ("rows", "real", "padding_gemm_rows", "rank_loads", "max_rows_per_rank")
    assert [{k: s[k] for k in figures} for s in exact["shapes"]] == \
        [{k: s[k] for k in figures} for s in interp["shapes"]]
    for key in ("padding_gemm_rows", "ep_excess_routes", "capacity", "padded_rows"):
        assert [s[key] for s in exact["trace_steps"]] == [s[key] for s in interp["trace_steps"]], key
    assert all(s["timed"] for s in exact["shapes"]) and not all(s["timed"] for s in interp["shapes"])


def test_bad_trace_real_points_is_refused(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(trace="example_chat_dp2.csv").replace("dp_size: 2,", "dp_size: 2, "
                                                                        "trace_real_points: -1,"))
    assert main(["run", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trace_real_points: must be >= 0, got -1" in err[0], err
    sweep.write_text(SWEEP.format(trace="example_chat_dp2.csv").replace("dp_size: 2,", "dp_size: 2, "
                                                                        "trace_real_points: 1.5,"))
    assert main(["run", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trace_real_points" in err[0], err
    from moebench.bench.serving_trace.knobs import ServingKnobs
    assert ServingKnobs(trace_real_points=-3).problem(Params()) == "trace_real_points: must be >= 0, got -3"


@pytest.mark.parametrize("key, value, message", [
    ("trace_shape_timings", "0", "trace_shape_timings: must be >= 1, got 0"),
    ("trace_shape_timings", "abc", "trace_shape_timings"),
    ("ep_rank_seconds", "0", "ep_rank_seconds: must be > 0, got 0"),
    ("ep_rank_seconds", "-5.0", "ep_rank_seconds: must be > 0, got -5.0")])
def test_a_bad_timing_budget_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys, key, value, message):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP.format(trace="example_chat_dp2.csv"))
    out = tmp_path / "out"
    assert main(["run", str(sweep), "--out", str(out), "--set", f"{key}={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() or not any(out.iterdir())


def test_a_padded_shape_holds_the_real_rows_of_its_real_only_shape():
    """(rows, real) and (real, real) differ by the padding only: same real rows (logits, hidden, bias), padding
    repeat-filled from the first of them, so their time difference is the padding's."""
    p = replace(Params(), **{**SMALL, "ep_size": 2}, padding_fill="repeat", bias=True)
    bench = ShapeBench(p, torch.device("cpu"), Timing(mode="wall", warmup=0, iters=1))
    _, padded = bench.batch(8, 3)
    _, alone = bench.batch(3, 3)
    assert padded.is_padding.tolist() == [False] * 3 + [True] * 5
    assert torch.equal(padded.logits[:3], alone.logits) and torch.equal(padded.hidden[:3], alone.hidden)
    assert torch.equal(padded.logits[3:], alone.logits[:1].expand(5, -1))
    assert torch.equal(padded.bias, alone.bias)


def test_a_second_run_in_one_process_measures_its_shapes_again(tmp_path):
    """The shape store lives for one run (RunContext.run_store): two in-process runs of the same sweep each time
    every shape; within a run, the second capture list reuses the first's."""
    from moebench.run.runner import run_sweep
    from moebench.run.results import load_records
    from moebench.run.sweep import load_sweep

    sets = [f"{k}={v}" for k, v in SMALL.items()] + [
        "num_expert_group=1", "topk_group=1", "dp_size=1", "sp_size=1", "trace=[3,5]", "axes.capture_sizes=[pow2,dense]",
        "trace_replay=0", "timing.iters=1", "timing.warmup=0"]
    sweep = load_sweep(ROOT / "sweeps" / "scenarios" / "padding_tax.yaml", sets)
    infos = []
    for n in range(2):
        code, run_dir = run_sweep(sweep, out_base=tmp_path / f"r{n}", device="cpu", isolate=False,
                                  out=open(os.devnull, "w"))
        assert code == 0
        infos.append({r["params"]["capture_sizes"]: r["info"] for r in load_records(run_dir)})
    for info in infos:
        assert info["pow2"]["shapes_measured"] == info["pow2"]["timed_shapes"] and info["pow2"]["shapes_reused"] == 0
        assert info["dense"]["shapes_reused"] > 0


def test_a_tax_inside_the_timings_noise_is_reported_as_such():
    """The padding time and the masks' saving against the shapes' spread: inside it, the table and the footer say
    `within noise` instead of a share (never a 3483% recovery or a negative tax); outside it, the figures."""
    from collections import Counter

    from moebench.bench.serving_trace.shapes import ShapeFigures
    from moebench.report import trace_tax

    def shape(rows, real, masked, oblivious, spread):
        return ShapeFigures(rows, real, {"masked": masked, "oblivious": oblivious}, {}, {}, {},
                            {"masked": spread, "oblivious": spread})

    calls = Counter({(8, 7): 100, (7, 7): 10})
    figures = {(8, 7): shape(8, 7, 1000.0, 1001.0, 5.0), (7, 7): shape(7, 7, 1000.3, 1000.2, 5.0)}
    tot = {"layer_us": {"masked": 110_003.0, "oblivious": 110_110.0},
           "padding_us": {"masked": -30.0, "oblivious": 80.0}}
    n = headline.noise(calls, figures, tot)
    # the padding time reads (8, 7) and, for its real tokens alone, (7, 7) 100 times each; the unpadded (7, 7)
    # calls add nothing to it (exactly 0), but their two sides' difference is part of the saving
    assert n["padding_us"]["masked"] == pytest.approx(2 ** 0.5 * 100 * 5, abs=1e-3)
    assert n["recovered_us"] == pytest.approx(2 ** 0.5 * ((100 * 5) ** 2 + (10 * 5) ** 2) ** 0.5, abs=1e-3)
    assert n["within_noise"] == {"padding_tax": {"masked": True, "oblivious": True}, "recovered": True}
    loud = headline.noise(calls, {k: shape(k[0], k[1], 1000, 1000, 0.01) for k in figures}, tot)
    assert loud["within_noise"] == {"padding_tax": {"masked": False, "oblivious": False}, "recovered": False}
    unknown = headline.noise(calls, {k: shape(k[0], k[1], 1000, 1000, None) for k in figures}, tot)
    assert unknown["within_noise"]["recovered"] is None

    def record(noise):
        head = {"layer_us": tot["layer_us"], "padding_us": tot["padding_us"],
                "padding_tax": {"masked": -30 / 110_003, "oblivious": 80 / 110_110}, "recovered_us": 107.0,
                "recovered_share": 107 / 80, "padded_rows": 100, "padding_row_share": 0.1,
                "padding_gemm_rows": {"masked": 0, "oblivious": 200}, "noise": noise}
        return {"target": "serving_trace", "status": "ok", "params": {},
                "info": {"headline": head, "engine": {"capture_list": "default", "dp_size": 1, "sp_size": 1,
                                                      "dbo": False, "ep_size": 1},
                         "trace": {"steps": 10, "source": "chat"}, "distinct_shapes": 2, "timed_shapes": 2}}

    _, (row,) = trace_tax.table([record(n)])
    assert row[5:8] == ["within noise", "within noise", "within noise"]
    text = "\n".join(trace_tax.footer_lines([record(n)]))
    assert "within noise" in text and "133.8%" not in text and "-0.0%" not in text
    _, (row,) = trace_tax.table([record(loud)])
    assert row[5] == "0.1%" and row[6] == "0.0%" and "133.8% of the padding time" in row[7]


def test_the_footer_reads_no_saving_where_nothing_was_padded_or_the_sides_are_not_comparable():
    """The dense list pads no row: no tax and nothing recovered (never "masks recover -308 ms"); where the masked
    layer is slower on the real rows alone, the tax pair and the recovery say `not comparable`, not a saving."""
    from moebench.report import trace_tax

    def record(padded_rows, real_only):
        head = {"layer_us": {"masked": 1_735_000.0, "oblivious": 1_448_000.0},
                "real_only_us": real_only,
                "padding_us": {s: {"masked": 1_735_000.0, "oblivious": 1_448_000.0}[s] - real_only[s]
                               for s in SIDES},
                "padding_tax": {"masked": 0.03, "oblivious": 0.05}, "recovered_us": -287_000.0,
                "recovered_share": None, "padded_rows": padded_rows, "padding_row_share": 0.1,
                "padding_gemm_rows": {"masked": 0, "oblivious": 2 * padded_rows}}
        return {"target": "serving_trace", "status": "ok", "params": {},
                "info": {"headline": head, "engine": {"capture_list": "pow2", "dp_size": 1, "sp_size": 1,
                                                      "dbo": False, "ep_size": 1},
                         "trace": {"steps": 10, "source": "chat"}, "distinct_shapes": 2, "timed_shapes": 2}}

    same = {"masked": 1_735_000.0, "oblivious": 1_448_000.0}
    _, (row,) = trace_tax.table([record(0, same)])
    assert row[5:8] == ["no padded row", "no padded row", "nothing (no padded row)"]
    text = "\n".join(trace_tax.footer_lines([record(0, same)]))
    assert "-287" not in text and "nothing (no padded row)" in text
    slower = {"masked": 1_680_000.0, "oblivious": 1_380_000.0}
    _, (row,) = trace_tax.table([record(40, slower)])
    assert row[5:7] == ["not comparable", "not comparable"] and row[7].startswith("not comparable (")
    assert "-287" not in "\n".join(trace_tax.footer_lines([record(40, slower)]))
