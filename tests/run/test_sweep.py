"""Sweep files: validation (one line naming file, key and reason; exit 2; nothing written), --set, expansion."""

import json
import textwrap
from pathlib import Path

import pytest

from moebench.cli import main
from moebench.params import EPLayout, Params, Point
from moebench.run.sweep import SweepError, apply_overrides, expand, load_sweep, parse_set

GOOD = """\
name: t
target: router
impls: [topk_softmax.torch]
fixed: {num_experts: 16, hidden: 64}
axes:
  num_tokens: [8, 16]
  top_k: [2, 6]
timing: {warmup: 1, iters: 3}
"""


def _write(tmp_path, text, name="s.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_good_sweep_expands_cartesian_product_in_file_order(tmp_path):
    sweep = load_sweep(_write(tmp_path, GOOD))
    points = expand(sweep)
    assert [(pt.params.num_tokens, pt.params.top_k) for pt in points] == [(8, 2), (8, 6), (16, 2), (16, 6)]
    assert all(pt.params.num_experts == 16 for pt in points)
    assert len({pt.key for pt in points}) == 4


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("run", sorted((REPO / "results" / "h200").glob("kernels_align-*")) +
                         sorted((REPO / "results" / "h200").glob("layer-*")))
def test_point_keys_are_those_of_the_committed_reference_runs(run):
    """Point.key is how runs are resumed and compared: the bundled sweep expands to the keys its reference run
    recorded, and each record's key is that of its own impl and params."""
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
    sweep = load_sweep(REPO / "sweeps" / f"{run.name.rsplit('-', 1)[0]}.yaml")
    assert [pt.key for pt in expand(sweep)] == [r["key"] for r in sorted(records, key=lambda r: r["point"])]
    assert all(Point(r["point"], r["impl"], Params(**r["params"])).key == r["key"] for r in records)


def test_set_overrides_are_yaml_values_and_move_between_fixed_and_axes(tmp_path):
    path = _write(tmp_path, GOOD)
    sweep = load_sweep(path, ["axes.top_k=[1, 3]", "fixed.num_experts=32"])
    assert sweep.axes["top_k"] == [1, 3] and sweep.fixed["num_experts"] == 32
    sweep = load_sweep(path, ["top_k=4"])  # a bare parameter becomes fixed and drops its axis
    assert "top_k" not in sweep.axes and sweep.fixed["top_k"] == 4
    assert parse_set("axes.mask=[true,false]") == (["axes", "mask"], [True, False])
    # never evaluated: a Python expression is just a string, which then fails type validation
    with pytest.raises(SweepError, match="fixed.num_tokens: expected int"):
        load_sweep(path, ["fixed.num_tokens=__import__('os').getpid()"])
    raw = apply_overrides({"axes": {"top_k": [1]}}, ["fixed.top_k=2"])
    assert raw == {"axes": {}, "fixed": {"top_k": 2}}


MALFORMED = [
    ("unknown top-level key", GOOD + "colour: red\n", "colour: unknown key"),
    ("unknown parameter", GOOD.replace("hidden: 64", "hiden: 64"), "fixed.hiden: unknown parameter"),
    ("wrong type", GOOD.replace("num_tokens: [8, 16]", "num_tokens: [8, many]"), "axes.num_tokens: expected int"),
    ("bool is not int", GOOD.replace("num_tokens: [8, 16]", "num_tokens: [true]"), "axes.num_tokens: expected int"),
    ("empty axis", GOOD.replace("num_tokens: [8, 16]", "num_tokens: []"), "axes.num_tokens: empty axis"),
    ("axis not a list", GOOD.replace("num_tokens: [8, 16]", "num_tokens: 8"), "axes.num_tokens: expected a list"),
    ("top_k > experts", GOOD.replace("top_k: [2, 6]", "top_k: [2, 17]"), "axes.top_k: 17 > num_experts 16"),
    ("groups not dividing", GOOD.replace("hidden: 64", "hidden: 64, num_expert_group: 3"),
     "fixed.num_expert_group: 3 does not divide num_experts 16"),
    ("ep_size not dividing", GOOD.replace("hidden: 64", "hidden: 64, ep_size: 5"),
     "fixed.ep_size: 5 does not divide num_experts 16"),
    ("padding ratio 1", GOOD.replace("top_k: [2, 6]", "top_k: [2, 6]\n  padding_ratio: [0.0, 1.0]"), "axes.padding_ratio: must be in [0, 1)"),
    ("negative padding ratio", GOOD.replace("hidden: 64", "hidden: 64, padding_ratio: -0.1"),
     "fixed.padding_ratio: must be in [0, 1)"),
    ("unknown impl", GOOD.replace("topk_softmax.torch", "topk_softmax.cuda"), "impls[0]: unknown impl"),
    ("impl for another target", GOOD.replace("target: router", "target: dispatch"),
     "impls[0]: topk_softmax.torch cannot run under target 'dispatch'"),
    ("unknown target", GOOD.replace("target: router", "target: everything"), "target: 'everything' is not one of"),
    ("bad choice", GOOD.replace("hidden: 64", "hidden: 64, padding_fill: ones"),
     "fixed.padding_fill: 'ones' is not one of"),
    ("bad timing mode", GOOD.replace("warmup: 1", "mode: fast, warmup: 1"), "timing.mode: 'fast' is not one of"),
    ("unknown timing key", GOOD.replace("warmup: 1", "warmups: 1"), "timing.warmups: unknown key"),
    ("missing target", GOOD.replace("target: router\n", ""), "target: missing"),
    ("not yaml", GOOD + "axes: [unclosed\n", "not valid YAML"),
    ("top level list", "- a\n- b\n", "top level: expected a mapping"),
    ("both fixed and axis", GOOD.replace("hidden: 64", "hidden: 64, top_k: 2"), "axes.top_k: also given under fixed"),
]


@pytest.mark.parametrize("label,text,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_sweep_rejected_with_one_line(tmp_path, label, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SweepError) as exc:
        load_sweep(path)
    line = str(exc.value)
    assert "\n" not in line
    assert line.startswith(str(path)), line
    assert message in line, line


# The command line in this process (main(argv)); tests/run/test_hostile_input.py runs the real entry point in a fresh one.
@pytest.mark.parametrize("label,text,message", MALFORMED[:12], ids=[m[0] for m in MALFORMED[:12]])
def test_cli_exit_2_and_nothing_written(tmp_path, capsys, label, text, message):
    path = _write(tmp_path, text)
    out = tmp_path / "results"
    plots = tmp_path / "plots"
    code = main(["run", str(path), "--out", str(out), "--plots", str(plots), "--device", "cpu"])
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], stderr
    assert not out.exists() and not plots.exists()
    assert stdout == ""


def test_cli_bad_set_expression(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    assert main(["run", str(path), "--set", "axes.top_k", "--dry-run"]) == 2
    assert "--set axes.top_k: expected key=value" in capsys.readouterr().err


def test_a_bad_set_value_names_the_set_that_gave_it(tmp_path, capsys):
    """A refused value says which --set wrote it, a top-level parameter under the fixed.<key> it became."""
    path = _write(tmp_path, GOOD)
    assert main(["run", str(path), "--set", "top_k=abc", "--dry-run", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "fixed.top_k: expected int" in err and err.rstrip().endswith("(from --set top_k=abc)")
    assert main(["run", str(path), "--set", "axes.top_k=abc", "--dry-run"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(from --set axes.top_k=abc)")
    assert not (tmp_path / "r").exists()


def test_dry_run_lists_points_and_writes_nothing(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    code = main(["run", str(path), "--dry-run", "--out", str(tmp_path / "r")])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    rows = [line for line in stdout.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(rows) == 4
    assert not (tmp_path / "r").exists()


def test_params_defaults_are_valid():
    from moebench.run.sweep import params_problem

    assert params_problem(Params()) is None
    assert Params(num_tokens=10, padding_ratio=0.25).num_padding == 2  # round(2.5) -> banker's rounding


def test_ep_layout_is_derived_from_params_once():
    p = Params(num_experts=32, ep_size=4)
    lay = EPLayout.of(p, rank=3)
    assert (lay.rank, lay.ep_size, lay.num_experts, lay.local_experts, lay.expert_offset) == (3, 4, 32, 8, 24)
    assert [lay.first_expert(r) for r in range(4)] == [0, 8, 16, 24]
    assert p.local_experts == 8 and Params(num_experts=32, ep_size=4, num_local_experts=5).local_experts == 5
    with pytest.raises(ValueError, match="ep_size: 3 does not divide num_experts 32"):
        EPLayout(0, 3, 32)
    with pytest.raises(ValueError, match="rank 4 not in"):
        EPLayout.of(p, rank=4)
