"""Paths in a sweep (docs/sweeps.md#paths-in-a-sweep): `trace_file` and `plugins` are looked for beside the sweep
file, then in the current directory, then among the bundled files; the sweep keeps the absolute path it found, so a
run resumed from another directory uses the same files; a file found nowhere is one line naming where it looked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moebench.cli import main
from moebench.run.paths import PathError, resolve_sweep_path
from moebench.run.results import load_records
from moebench.run.sweep import load_sweep
from moebench.traces.csv_trace import BUNDLED_DIR

TAX = """\
name: my_tax
target: serving_trace
impls: [serving_trace.layer]
fixed: {{num_experts: 8, top_k: 2, hidden: 64, intermediate: 32, group_size: 16, block_size: 16, dp_size: 2,
        trace_file: {trace}}}
timing: {{warmup: 0, iters: 1}}
"""


def _tax(tmp_path: Path, trace: str = "my_trace.csv") -> Path:
    (tmp_path / "tax").mkdir(exist_ok=True)
    sweep = tmp_path / "tax" / "my_tax.yaml"
    sweep.write_text(TAX.format(trace=trace))
    return sweep


def test_a_trace_beside_the_sweep_is_found_from_another_directory(tmp_path, monkeypatch, capsys):
    _tax(tmp_path)
    (tmp_path / "tax" / "my_trace.csv").write_text("dp0,dp1\n12,9\n14,0\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "tax/my_tax.yaml", "--dry-run"]) == 0
    assert f"trace_file = {tmp_path / 'tax' / 'my_trace.csv'}" in capsys.readouterr().out
    (tmp_path / "my_trace.csv").write_text("not even a header\n")  # the sweep's folder comes first
    assert load_sweep("tax/my_tax.yaml").fixed["trace_file"] == str(tmp_path / "tax" / "my_trace.csv")


def test_then_the_current_directory_then_the_bundled_traces(tmp_path, monkeypatch):
    sweep = _tax(tmp_path)
    (tmp_path / "my_trace.csv").write_text("num_tokens\n5\n")
    monkeypatch.chdir(tmp_path)
    assert load_sweep(sweep).fixed["trace_file"] == str(tmp_path / "my_trace.csv")
    sweep.write_text(TAX.format(trace="example_chat_dp2.csv"))
    assert load_sweep(sweep).fixed["trace_file"] == str(BUNDLED_DIR / "example_chat_dp2.csv")
    sweep.write_text(TAX.format(trace="null").replace(",\n        trace_file: null}", "}").replace(
        "impls:", "axes: {trace_file: [my_trace.csv, example_chat_dp2.csv]}\nimpls:"))
    assert load_sweep(sweep).axes["trace_file"] == [str(tmp_path / "my_trace.csv"),
                                                    str(BUNDLED_DIR / "example_chat_dp2.csv")]


def test_a_missing_file_is_one_line_naming_where_it_looked(tmp_path, monkeypatch, capsys):
    _tax(tmp_path, trace="gone.csv")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "tax/my_tax.yaml", "--out", str(tmp_path / "runs"), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and out == "" and not (tmp_path / "runs").exists()
    assert (f"tax/my_tax.yaml: fixed.trace_file: gone.csv: no such file beside the sweep ({tmp_path / 'tax'}), in "
            f"the current directory ({tmp_path}) or bundled with moebench ({BUNDLED_DIR}: example_chat_dp2.csv)"
            in err), err
    with pytest.raises(PathError, match=r"^/no/such\.csv: no such file$"):
        resolve_sweep_path("/no/such.csv", tmp_path)


PLUGIN = '''
from moebench import registry
from moebench.check import CheckResult
from moebench.registry import Case

if "testonly_paths.probe" not in registry.all_impls():
    registry.register_impl("testonly_paths.probe", targets=("kernel",))(
        lambda p, ctx: Case(run=lambda: None, check=lambda: CheckResult(True)))
'''

PROBE = """\
name: probe
target: kernel
plugins: [moebench_test_paths_plugin]
impls: [testonly_paths.probe]
fixed: {trace_file: steps.csv}
axes: {num_tokens: [3, 5]}
timing: {warmup: 0, iters: 1}
"""


def test_a_resume_from_another_directory_finds_the_same_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sweeps" / "probe.yaml").write_text(PROBE)
    (tmp_path / "sweeps" / "steps.csv").write_text("num_tokens\n7\n")
    (tmp_path / "sweeps" / "moebench_test_paths_plugin.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "sweeps/probe.yaml", "--out", "runs", "--device", "cpu", "--no-plots", "--in-process"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    stored = json.loads((run_dir / "manifest.json").read_text())["sweep"]
    assert stored["fixed"]["trace_file"] == str(tmp_path / "sweeps" / "steps.csv")
    assert stored["plugins"] == [str(tmp_path / "sweeps" / "moebench_test_paths_plugin.py")]
    records = (run_dir / "records.jsonl").read_text().splitlines()
    (run_dir / "records.jsonl").write_text(records[0] + "\n")  # as if killed after the first point
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir), "--device", "cpu", "--no-plots", "--in-process"]) == 0, \
        capsys.readouterr().err
    assert sorted(r["params"]["num_tokens"] for r in load_records(run_dir)) == [3, 5]
    # the sweep given again from there resolves to the same files: the same sweep
    assert main(["run", "../sweeps/probe.yaml", "--resume", str(run_dir), "--device", "cpu", "--no-plots",
                 "--in-process"]) == 0, capsys.readouterr().err


def test_a_plugin_in_the_current_directory_and_a_missing_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "sweeps").mkdir()
    sweep = tmp_path / "sweeps" / "probe.yaml"
    sweep.write_text(PROBE.replace("moebench_test_paths_plugin", "moebench_test_paths_cwd_plugin")
                     .replace("fixed: {trace_file: steps.csv}\n", ""))
    (tmp_path / "moebench_test_paths_cwd_plugin.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    assert load_sweep(sweep).plugins == (str(tmp_path / "moebench_test_paths_cwd_plugin.py"),)
    sweep.write_text(PROBE.replace("moebench_test_paths_plugin", "no_such_moebench_plugin"))
    assert main(["run", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plugins[0]: no plugin module 'no_such_moebench_plugin'" in err
    assert f"beside the sweep ({tmp_path / 'sweeps'}), in the current directory ({tmp_path}) or on sys.path" in err


def test_a_plugin_beside_the_sweep_comes_before_one_of_that_name_on_sys_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)  # as `python -m moebench` puts the cwd first
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "moebench_test_paths_shadowed.py").write_text("raise ImportError('the shadowed copy was imported')\n")
    (tmp_path / "sweeps" / "moebench_test_paths_shadowed.py").write_text(
        PLUGIN.replace("testonly_paths.probe", "testonly_paths.beside"))
    sweep = tmp_path / "sweeps" / "probe.yaml"
    sweep.write_text(PROBE.replace("moebench_test_paths_plugin", "moebench_test_paths_shadowed")
                     .replace("testonly_paths.probe", "testonly_paths.beside")
                     .replace("fixed: {trace_file: steps.csv}\n", ""))
    monkeypatch.chdir(tmp_path)
    assert load_sweep(sweep).impls == ("testonly_paths.beside",)
