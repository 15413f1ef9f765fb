"""Plugins: a user's kernels through the bundled sweeps (a correct one ok, a wrong one wrong), the `plugins:` key,
the one-line error of an unimportable plugin, dispatch paths, and the worked example of docs/plugins.md as
written there."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moebench import registry
from moebench.cli import main
from moebench.params import Params
from moebench.plugins import register_dispatch_path
from moebench.registry import RunContext
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import SweepError, load_sweep

REPO = Path(__file__).resolve().parent.parent

PLUGIN = '''
import torch

from moebench.plugins import register_kernel


def _route(logits, top_k, renormalize, is_padding, bias, out, wrong):
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.topk(probs if bias is None else probs + bias, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if renormalize and not wrong:  # the wrong one forgets to renormalise
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if is_padding is not None:
        weights = weights.masked_fill(is_padding[:, None], 0.0)
        ids = ids.masked_fill(is_padding[:, None], -1)
    out[0].copy_(weights)
    out[1].copy_(ids)
    return out


def good(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
    return _route(logits, top_k, renormalize, is_padding, bias, out, wrong=False)


def bad(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
    return _route(logits, top_k, renormalize, is_padding, bias, out, wrong=True)


register_kernel("topk_softmax", "plugin_good", good, description="a user's correct router")
register_kernel("topk_softmax", "plugin_bad", bad, description="a user's router that forgets to renormalise")
'''

SWEEP = """\
name: plugged
target: router
plugins: [{module}]
impls: [topk_softmax.torch, topk_softmax.plugin_good, topk_softmax.plugin_bad]
fixed: {{num_experts: 16, top_k: 4}}
axes:
  num_tokens: [8, 32]
  padding_ratio: [0.0, 0.5]
timing: {{warmup: 1, iters: 3}}
"""


def test_plugin_module_registers_a_correct_and_a_wrong_router(tmp_path, capsys):
    module = "moebench_test_plugin_routers"
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    sweep_file = tmp_path / "plugged.yaml"
    sweep_file.write_text(SWEEP.format(module=module))  # found next to the sweep file
    sweep = load_sweep(sweep_file)
    assert sweep.plugins == (str(tmp_path / f"{module}.py"),)  # the sweep keeps the file it found
    assert registry.get("topk_softmax.plugin_good").library == "plugin"
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu")
    assert code == 1  # a wrong point makes the run exit 1
    status = {}
    for r in load_records(run_dir):
        status.setdefault(r["impl"], set()).add(r["status"])
    assert status == {"topk_softmax.torch": {"ok"}, "topk_softmax.plugin_good": {"ok"},
                      "topk_softmax.plugin_bad": {"wrong"}}
    recs = [r for r in load_records(run_dir) if r["impl"] == "topk_softmax.plugin_good"]
    assert all(r["imbalance"] and r["samples_us"] and r["library"] == "plugin" for r in recs)
    out = capsys.readouterr().out
    assert "vs best peer" in out  # the reference and the good plugin are compared with the best peer


def test_unimportable_plugin_is_exit_2_naming_the_module(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader may append the sweep's folder
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(SWEEP.format(module="no_such_moebench_plugin"))
    assert main(["run", str(sweep_file), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no_such_moebench_plugin" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_plugin_key_must_name_modules(tmp_path):
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(SWEEP.format(module="[1]").replace("plugins: [[1]]", "plugins: [3]"))
    with pytest.raises(SweepError, match=r"plugins\[0\]"):
        load_sweep(sweep_file)


def test_register_kernel_refuses_unknown_family():
    from moebench.plugins import register_kernel

    with pytest.raises(ValueError, match="unknown kernel family"):
        register_kernel("no_such_family", "x", lambda: None)


def test_register_dispatch_path_times_a_path_like_moebench_s_own():
    from moebench.dispatch.agrs import AGRSPath

    name = "dispatch.plugin_agrs"
    if name not in registry.all_impls():
        assert register_dispatch_path("plugin_agrs", type("PluginAGRS", (AGRSPath,), {})) == name
    impl = registry.get(name)
    assert impl.multi_rank
    case = impl.build(Params(num_tokens=16, hidden=64, num_experts=8, top_k=2, padding_ratio=0.25),
                      RunContext(device=torch.device("cpu")))
    res = case.check()
    assert res.ok, res.detail
    case.cleanup()


def _doc_blocks(lang: str) -> list[str]:
    """The fenced blocks of docs/plugins.md whose info string is `lang` ("" for a bare fence)."""
    blocks, current, info = [], None, ""
    for line in (REPO / "docs" / "plugins.md").read_text().splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current, info = [], line.strip()[3:]
            else:
                if info == lang:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_docs_worked_example_runs_as_written(tmp_path, capsys, monkeypatch):
    """The command as the page writes it, given to the CLI's main in this process from the folder that holds the
    two files (its exit code, output and records are what is checked; a fresh interpreter adds only start-up)."""
    (tmp_path / "my_router.py").write_text(_doc_blocks("python")[0])
    (tmp_path / "my_sweep.yaml").write_text(_doc_blocks("yaml")[0])
    command = textwrap.dedent(_doc_blocks("")[0]).split()
    assert command[:2] == ["moebench", "run"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the plugin folder the run appends is not left behind
    code = main(command[1:])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    records = [json.loads(line) for run in (tmp_path / "results").rglob("records.jsonl")
               for line in run.read_text().splitlines()]
    assert {(r["impl"], r["status"]) for r in records} == {("topk_softmax.triton", "ok"), ("topk_softmax.mine", "ok")}
    assert "vs best peer" in out
    # the example ignores `out`: its imbalance is that of the ids it returns (the reference's, as the Triton
    # router's at the same point), never of the poisoned buffers
    assert not [r for r in records if "imbalance_error" in r]
    load = {(r["impl"], r["params"]["num_tokens"], r["params"]["padding_ratio"]):
            r["imbalance"]["expert"]["max_over_mean"] for r in records}
    for (impl, tokens, pad), value in load.items():
        assert value == load[("topk_softmax.triton", tokens, pad)]
    rows = [line.split() for line in out.splitlines() if "topk_softmax.mine" in line and line.split()[-1] == "ok"]
    assert len(rows) == 4 and all(row[-4] not in ("-", "err") for row in rows)  # the maxvio column


OUT_OF_RANGE = '''
import torch

from moebench.plugins import register_kernel


def shifted(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return weights, (ids + logits.shape[1]).to(torch.int32)  # every id past the last expert


register_kernel("topk_softmax", "shifted", shifted)
'''


def test_a_missing_imbalance_is_marked_in_the_table_and_explained_in_the_record(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "moebench_test_plugin_shifted.py").write_text(OUT_OF_RANGE)
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("name: shifted\ntarget: router\nplugins: [moebench_test_plugin_shifted]\n"
                          "impls: [topk_softmax.shifted]\nfixed: {num_experts: 16, top_k: 2, num_tokens: 8}\n"
                          "timing: {warmup: 0, iters: 1}\n")
    assert main(["run", str(sweep_file), "--device", "cpu", "--no-plots", "--out", str(tmp_path / "r")]) == 1
    (rec,) = [json.loads(line) for f in (tmp_path / "r").rglob("records.jsonl") for line in f.read_text().splitlines()]
    assert rec["status"] == "wrong" and "imbalance" not in rec
    assert "outside" in rec["imbalance_error"]  # what the kernel returned, judged
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if "topk_softmax.shifted" in line
              and not line.startswith("#")]
    assert row[-4] == "err"
