"""serving_trace.capture_search at the scenario's cpu size: padding_tax on a list the search found reproduces the
searched figures (same run, same shapes, same model), the CLI verb prints the operator's table, headline and plot,
and refuses bad input in one line with nothing written."""

import dataclasses
from pathlib import Path

import pytest
import torch

from moebench.bench import capture_search
from moebench.bench import serving_trace
from moebench.bench.serving_trace import capture_pricing
from moebench.cli import main
from moebench.registry import RunContext
from moebench.report.capture_search import table_lines
from tests.bench.serving_trace.test_capture_search_report import search_info
from moebench.run.results import load_records
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[3]
FAST = ["timing.iters=1", "timing.warmup=0", "timing.unroll=1"]


def test_padding_tax_on_the_list_found_reproduces_the_searched_figure():
    # the layer's figures are what this checks (the EP step's: test_capture_ep.py), so its rank plan is small
    sweep = load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml", FAST + ["ep_rank_timings=4"],
                       size="cpu")
    (point,) = expand(sweep)
    ctx = RunContext(device=torch.device("cpu"))
    info = capture_search.build(point.params, ctx).info
    sides = info["capture_search"]["sides"]
    assert info["shape_plan"]["shape_times"] == "exact"
    for side in ("masked", "oblivious"):
        row = sides[side]["per_k"]["2"]
        assert 1 <= len(row["sizes"]) <= 2
        # the DP's figure and the composed one agree (two arithmetics over one timer)
        assert row["searched_us"] == pytest.approx(row["figures"][side]["time_us"], rel=1e-9)
        p = dataclasses.replace(capture_search._layer_params(point.params), capture_sizes=row["sizes"])
        head = serving_trace.build(p, ctx).info
        assert head["shapes_measured"] == 0  # every shape reused from the search's pricing
        got = head["headline"]
        for both in ("masked", "oblivious"):  # the list's layer time, each side, to the bit (both sums are fsums of
            # the same products)
            assert got["layer_us"][both] == row["figures"][both]["layer_us"]
            assert got["padding_us"][both] == row["figures"][both]["padding_us"]
        # the steps above the list's largest size: padding_tax prices them unpadded, the search adds their launches
        eager = row["figures"][side]
        assert eager["time_us"] == eager["layer_us"] + eager["eager_launch_us"]
        assert (eager["eager_calls"] > 0) == (max(row["sizes"]) < 7)
    priced = sides["masked"]["priced"]
    assert priced["candidates"] == [2, 3, 5, 7] and sum(priced["weight"]) == 6
    # on a CPU graphs do not exist: the eager steps are priced at the documented launch figure, and say so
    eager = info["capture_search"]["eager"]
    assert eager["source"] == "documented figure" and "measured" not in eager
    (line,) = [line for line in table_lines(info) if line.startswith("eager steps:")]
    assert "documented figure (docs/hardware.md" in line


def _scenario_point():
    sweep = load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml", FAST, size="cpu")
    (point,) = expand(sweep)
    return point


def test_on_a_cpu_the_eager_price_is_the_documented_figure():
    from moebench.bench.serving_trace.shapes import ShapeBench

    p = capture_search._layer_params(_scenario_point().params)
    bench = ShapeBench(p, torch.device("cpu"), serving_trace.SHAPE_TIMING["cpu"])
    eager = capture_pricing.eager_price(bench, [(7, 5), (7, 7)])
    assert eager["source"] == "documented figure" and "measured" not in eager
    for side in ("masked", "oblivious"):
        assert eager["launches_per_call"][side] > 0
        assert eager["per_call_us"][side] == pytest.approx(eager["launches_per_call"][side] * (4.06 - 1.08))
    (line,) = [line for line in table_lines(search_info(eager)) if line.startswith("eager steps:")]
    assert "documented figure" in line and "measured" not in line
    # on a GPU the estimate counts the eager timing at the trace's largest real count and the one nearest half of it
    assert capture_search.search_work(_scenario_point().params, "cuda")["eager_shapes"] == [(3, 3), (7, 7)]


@pytest.mark.gpu
def test_on_a_gpu_the_eager_price_is_measured_on_the_layer():
    point = _scenario_point()
    case = capture_search.build(point.params, RunContext(device=torch.device("cuda")))
    info = case.info
    eager = info["capture_search"]["eager"]
    assert eager["source"] == "measured", eager
    got = eager["measured"]
    assert [tuple(s) for s in got["shapes"]] == capture_search.search_work(point.params, "cuda")["eager_shapes"]
    for side in ("masked", "oblivious"):
        assert len(got["eager_us"][side]) == len(got["graph_us"][side]) == len(got["shapes"]) == 2
        assert all(v > 0 for v in got["eager_us"][side] + got["graph_us"][side])
        assert got["over_graph_us"][side] == pytest.approx(
            [e - g for e, g in zip(got["eager_us"][side], got["graph_us"][side])], abs=2e-3)
        want = max(0.0, sum(got["over_graph_us"][side]) / 2)
        assert eager["per_call_us"][side] == pytest.approx(want, abs=2e-3)
        for figs in info["capture_search"]["named"].values():  # every eager call priced at the measured figure
            f = figs[side]
            assert f["eager_launch_us"] == pytest.approx(f["eager_calls"] * eager["per_call_us"][side], abs=1e-2)
    (line,) = [line for line in table_lines(info) if line.startswith("eager steps:")]
    assert "measured on this layer at (3 rows, 3 real), (7 rows, 7 real)" in line and "documented" not in line
    assert case.check().ok


def test_the_cli_verb_at_size_cpu_prints_the_table_headline_and_plot(tmp_path, capsys):
    code = main(["capture-search", "chat", "--model", "deepseek-v3", "--graphs", "1,2", "--steps", "3",
                 "--max-tokens", "6", "--dp-size", "2", "--ep-size", "2", "--size", "cpu", "--device", "cpu",
                 "--out", str(tmp_path), "--in-process", "--seed", "1", "--set", "timing.iters=1", "--set",
                 "timing.warmup=0", "--set", "ep_rank_timings=4"])
    out = capsys.readouterr().out
    assert code == 0, out
    (rec,) = load_records(next(tmp_path.iterdir()))
    params = rec["params"]  # the size's layer, the command's own trace and engine
    assert (params["num_experts"], params["hidden"], params["dp_size"], params["ep_size"]) == (8, 64, 2, 2)
    assert "# the EP step over the trace (the slowest of 2 EP ranks" in out and "# headline: EP step: " in out
    assert "# headline: " in out and "cost what `fine`'s 51 cost; masked," in out
    assert "vs default" in out and "within 1% of it" in out
    # in an operator's words: a saving or a cost against a named list, no Python dict on the eager line
    assert any(w in out for w in (" saved", " more", "the same")) and "{'" not in out
    (run,) = list(tmp_path.iterdir())
    assert (run / "plots" / "capture_search.png").stat().st_size > 0


@pytest.mark.parametrize("argv,why", [
    (["--graphs", "0"], "graph budget K=0 outside 1.."),
    (["--graphs", "4", "--largest", "4000"], "fixed largest size 4000 is not a candidate size"),
    (["--graphs", "1", "--keep", "4001,4002"], "K=1 below the 2 sizes that must stay"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, argv, why):
    code = main(["capture-search", "chat", "--model", "deepseek-v3", "--steps", "20", "--device", "cpu",
                 "--out", str(tmp_path / "runs"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and why in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_an_empty_trace_is_refused(tmp_path, capsys):
    csv = tmp_path / "idle.csv"
    csv.write_text("num_tokens\n0\n0\n")
    code = main(["capture-search", str(csv), "--model", "deepseek-v3", "--device", "cpu",
                 "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "no step with a real token" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
