"""serving_trace.capture_search at the scenario's cpu size: padding_tax on a list the search found reproduces the
searched figures (same run, same shapes, same model), the CLI verb prints the operator's table, headline and plot,
and refuses bad input in one line with nothing written."""

import dataclasses
from pathlib import Path

import pytest
import torch

from moebench.bench import capture_search
from moebench.bench import serving_trace
from moebench.cli import main
from moebench.registry import RunContext
from moebench.run.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parents[3]
FAST = ["timing.iters=1", "timing.warmup=0", "timing.unroll=1"]
# the scenario's cpu shapes (Triton's interpreter), as --set options of the CLI verb
SMALL = [a for kv in ("num_experts=8", "top_k=2", "num_expert_group=1", "topk_group=1", "hidden=64",
                      "intermediate=32", "group_size=16", "block_size=16") for a in ("--set", kv)]


def test_padding_tax_on_the_list_found_reproduces_the_searched_figure():
    sweep = load_sweep(ROOT / "sweeps" / "scenarios" / "capture_search.yaml", FAST, size="cpu")
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


def test_the_cli_verb_prints_the_table_headline_and_plot(tmp_path, capsys):
    code = main(["capture-search", "chat", "--model", "deepseek-v3", "--graphs", "1,2", "--steps", "3",
                 "--max-tokens", "6", "--dp-size", "2", "--ep-size", "2", "--shape-timings", "64",
                 "--device", "cpu", "--out", str(tmp_path), "--in-process", "--seed", "1", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
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
