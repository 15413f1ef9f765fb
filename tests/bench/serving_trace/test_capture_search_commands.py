"""Every command that finishes a capture-search run gives the operator's answer: `moebench capture-search --size
cpu` (the scenario's CPU shapes for the layer, the question still the options'), a run interrupted and resumed with
`moebench run --resume`, and `moebench run capture_search --size cpu`: each prints the table and headline under the
run's table and draws the plot (one of the run's figures, counted with them). A size the scenario does not declare
is one line, exit 2, nothing written."""

from argparse import Namespace
from pathlib import Path

from moebench.cli import main
from moebench.run.capture_search import capture_search_sweep
from moebench.run.results import load_records

FAST = ["--set", "timing.iters=1", "--set", "timing.warmup=0"]
# the scenario's cpu shapes (Triton's interpreter), as --set options: the command as it was before --size
SMALL = [a for kv in ("num_experts=8", "top_k=2", "num_expert_group=1", "topk_group=1", "hidden=64",
                      "intermediate=32", "group_size=16", "block_size=16", "trace_shape_timings=64")
         for a in ("--set", kv)]
TINY_TRACE = ["chat", "--model", "deepseek-v3", "--graphs", "1,2", "--steps", "3", "--max-tokens", "6",
              "--dp-size", "2", "--device", "cpu", "--in-process", "--seed", "1"]


def _answer_printed(out: str, run: Path) -> None:
    """The operator's table, its headline and the plot, once, under the run's table."""
    assert out.count("# capture search: ") == 1, out
    assert "vs default" in out and "within 1% of it" in out and "# named lists: " in out
    assert "# headline: " in out and "cost what `fine`'s 51 cost" in out
    assert (run / "plots" / "capture_search.png").stat().st_size > 0
    assert f"# plot: {run / 'plots' / 'capture_search.png'}" in out
    # drawn once, as one of the run's figures, and counted with them
    assert f"# plots: 1 written to {run / 'plots'}" in out and out.count("capture_search.png") == 1


def _args(**given) -> Namespace:
    base = dict(trace="chat", model="deepseek-v3", ep_size=1, dp_size=3, sp_size=1, dbo=False, fill="repeat", seed=0,
                graphs=None, steps=10, max_tokens=64, largest=None, keep=None, shape_timings=None, set=None, size=None)
    return Namespace(**{**base, **given})


def test_size_cpu_reshapes_the_layer_and_keeps_the_question():
    fixed = capture_search_sweep(_args(size="cpu"))["fixed"]
    # the scenario's cpu shapes and shape budget
    assert (fixed["num_experts"], fixed["hidden"], fixed["intermediate"]) == (8, 64, 32)
    assert fixed["trace_shape_timings"] == 64
    # the question stays the options': the trace drawn from chat (no explicit list), the engine, the budgets
    assert "trace" not in fixed and fixed["trace_distribution"] == "chat" and fixed["trace_steps"] == 10
    assert (fixed["dp_size"], fixed["ep_size"]) == (3, 1) and "capture_graphs" not in fixed
    # --shape-timings and --set win over the size, as --set does over `moebench run --size`
    fixed = capture_search_sweep(_args(size="cpu", shape_timings=5, set=["hidden=128"]))["fixed"]
    assert (fixed["trace_shape_timings"], fixed["hidden"]) == (5, 128)


def test_an_unknown_size_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    code = main(["capture-search", "chat", "--model", "deepseek-v3", "--size", "gpu", "--device", "cpu",
                 "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--size gpu:" in err and "capture_search.yaml has no size 'gpu' (sizes: cpu)" in err
    assert not (tmp_path / "runs").exists()


def test_a_resumed_capture_search_prints_its_answer(tmp_path, capsys, monkeypatch):
    from moebench.run import runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute_point", interrupted)  # Ctrl-C in the point
    code = main(["capture-search", *TINY_TRACE, "--out", str(tmp_path), *SMALL])
    err = capsys.readouterr().err
    (run,) = tmp_path.iterdir()
    assert code == 130 and f"resume with: moebench run --resume {run}" in err
    assert load_records(run) == []
    monkeypatch.undo()
    code = main(["run", "--resume", str(run), "--in-process"])
    out = capsys.readouterr().out
    assert code == 0, out
    _answer_printed(out, run)


def test_the_scenario_through_run_prints_the_same_answer(tmp_path, capsys):
    code = main(["run", "capture_search", "--size", "cpu", "--device", "cpu", "--out", str(tmp_path),
                 "--in-process", *FAST, "--set", "ep_rank_timings=4"])  # the EP step's plan, small (the answer's
    # print is what this checks; tests/bench/serving_trace/test_capture_ep.py times every rank workload)
    out = capsys.readouterr().out
    assert code == 0, out
    (run,) = tmp_path.iterdir()
    _answer_printed(out, run)
    assert "# capture search: 6 steps (4 distinct), 4 candidate sizes" in out
    assert "# headlines (without the fix | with it):" in out  # the scenario's declared headlines stay


def test_the_search_keys_are_in_the_sweep_docs_key_tables():
    """docs/sweeps.md's parameter tables give every key of the search's knob group its type, default and meaning."""
    import dataclasses
    import re

    from moebench.bench.capture_search import CaptureSearchKnobs

    text = (Path(__file__).resolve().parents[3] / "docs" / "sweeps.md").read_text(encoding="utf-8")
    assert "`CaptureSearchKnobs`" in text
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows.update({key: cells for key in re.findall(r"`([^`]+)`", cells[0])})
    for field in dataclasses.fields(CaptureSearchKnobs):
        assert field.name in rows, f"{field.name}: no row in docs/sweeps.md"
        _, type_default, meaning = rows[field.name]
        default = "null" if field.default is None else str(field.default)
        assert type_default.endswith(f", {default}") and meaning, rows[field.name]
