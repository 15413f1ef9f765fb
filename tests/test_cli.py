"""The other subcommands: compare, list, plot (and their one-line errors)."""

import json
import subprocess
import sys

from moebench.cli import main
from moebench.report.compare import compare_records, compare_runs


def _rec(key, impl, p50, status="ok", **params):
    return {"key": key, "impl": impl, "status": status, "params": params, "stats": {"p50": p50}}


def _write_run(path, records, axes):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"sweep": {"name": "x", "axes": axes}}))
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_matches_by_key_and_skips_non_ok():
    a = [_rec("k1", "i.triton", 10.0, num_tokens=1), _rec("k2", "i.triton", 20.0, num_tokens=2),
         _rec("k3", "i.triton", 5.0, status="failed", num_tokens=3)]
    b = [_rec("k2", "i.triton", 10.0, num_tokens=2), _rec("k1", "i.triton", 15.0, num_tokens=1),
         _rec("k3", "i.triton", 1.0, num_tokens=3), _rec("k4", "i.triton", 1.0, num_tokens=4)]
    rows = compare_records(a, b)
    assert [(r["params"]["num_tokens"], r["ratio"]) for r in rows] == [(2, 0.5), (1, 1.5)]


def test_compare_runs_prints_ratios_and_geomean(tmp_path, capsys):
    _write_run(tmp_path / "a", [_rec("k1", "i.triton", 10.0, num_tokens=1),
                                _rec("k2", "i.triton", 20.0, num_tokens=2)], {"num_tokens": [1, 2]})
    _write_run(tmp_path / "b", [_rec("k1", "i.triton", 40.0, num_tokens=1),
                                _rec("k2", "i.triton", 5.0, num_tokens=2)], {"num_tokens": [1, 2]})
    assert compare_runs(tmp_path / "a", tmp_path / "b") == 0
    out = capsys.readouterr().out
    assert "2 matching points" in out and "4.000" in out and "0.250" in out
    assert "geometric mean B/A: 1.000" in out


def test_cli_compare_and_plot_reject_non_run_dirs(tmp_path, capsys):
    for args in (("compare", str(tmp_path), str(tmp_path)), ("plot", str(tmp_path))):
        code = main(list(args))
        err = capsys.readouterr().err
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "not a run directory" in lines[0], err


def test_cli_list_names_impls_and_bundled_sweeps():
    """A fresh process: what the registry discovers by itself, with nothing imported before."""
    proc = subprocess.run([sys.executable, "-m", "moebench", "list"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("topk_softmax.triton", "layer.masked", "dispatch.a2a_fixed", "jit_trace.a2a_fixed",
                 "fused_experts.oblivious", "quickstart", "routers"):
        assert name in proc.stdout
    import importlib.util

    (deepep_line,) = [line for line in proc.stdout.splitlines() if line.split()[:1] == ["dispatch.deepep"]]
    if importlib.util.find_spec("deep_ep") is None:  # the line says why it cannot run here
        assert " no " in deepep_line and "deep_ep not installed" in deepep_line


def test_every_argument_of_every_subcommand_has_help():
    import argparse

    from moebench.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {action.dest}" for name, p in sub.choices.items() for action in p._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing


def test_dry_run_checks_the_device_and_the_output_folder_as_a_run_does(tmp_path, capsys):
    assert main(["run", "quickstart", "--device", "gpu", "--dry-run"]) == 2
    assert "--device: 'gpu' is not cuda, cuda:N or cpu" in capsys.readouterr().err
    afile = tmp_path / "f"
    afile.write_text("")
    assert main(["run", "quickstart", "--device", "cpu", "--dry-run", "--out", str(afile)]) == 2
    assert "--out" in capsys.readouterr().err


def test_a_preset_overridden_by_explicit_keys_is_noted_on_stderr(capsys):
    assert main(["run", "quickstart", "--set", "fixed.model=kimi-k2", "--dry-run", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "moebench: note: model kimi-k2: num_experts 384 -> 64, top_k 8 -> 4" in err
    assert "model = kimi-k2" in out
    assert main(["run", "quickstart", "--set", "fixed.model=gpt-oss-20b", "--set", "num_experts=32", "--dry-run",
                 "--device", "cpu"]) == 0
    assert "note" not in capsys.readouterr().err  # the explicit values equal the preset's: nothing overridden
