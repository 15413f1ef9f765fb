"""Launch configs as data (kernels._details.tuning) and `moebench tune` (run/tune.py): explicit > table > rule, the
bucket keys, a table built from a tiny CPU run and then used by the kernels, and the one-line refusals."""

import json
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from moebench.cli import main
from moebench.kernels.runtime import tuning
from moebench.kernels.masked_moe_sum import SUM_CANDIDATES, masked_moe_sum, masked_moe_sum_torch, sum_choice
from moebench.run.results import load_manifest, load_records
from moebench.run.tune import tuned_with

TWO = ["r1_h512_w1_none", "r2_h1024_w4_evict_first"]
SWEEP = textwrap.dedent(f"""\
    name: tiny_tune
    target: kernel
    impls: [masked_moe_sum.triton]
    fixed: {{num_experts: 8, top_k: 2, hidden: 64, num_tokens: 6}}
    axes:
      padding_ratio: [0.0, 0.5]
      config: [{", ".join(TWO)}]
    timing: {{mode: wall, warmup: 0, iters: 2}}
    """)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """The kernels read their tables from a fresh folder (the package's own stays untouched)."""
    d = tmp_path / "tables"
    d.mkdir()
    monkeypatch.setattr(tuning, "TABLES_DIR", d)
    tuning.clear_cache()
    yield d
    tuning.clear_cache()


def _write(d, kernels):
    (d / "cpu.json").write_text(json.dumps({"format": 1, "gpu": "cpu", "kernels": kernels}))
    tuning.clear_cache()


def test_explicit_beats_table_beats_rule(tables):
    rule = sum_choice(6, 2, 64, "cpu")
    # H=64 is narrower than every candidate: the rule's launch is named as none of them
    assert (rule.source, rule.name, rule.bucket, rule.gpu) == ("rule", "rule:r1_h64_w1_none", "T=8,K=2,H=64", "cpu")
    _write(tables, {"masked_moe_sum": {"T=8,K=2,H=64": {"config": "r1_h1024_w8_none"}}})
    table = sum_choice(6, 2, 64, "cpu")
    assert (table.source, table.name, table.config) == ("table", "r1_h1024_w8_none", SUM_CANDIDATES["r1_h1024_w8_none"])
    assert sum_choice(6, 2, 64, "cpu", "auto").source == "table"  # "auto" is no config
    assert sum_choice(6, 2, 72, "cpu").source == "rule"  # another bucket: the rule
    explicit = sum_choice(6, 2, 64, "cpu", "r2_h1024_w4_cg")
    assert (explicit.source, explicit.name) == ("explicit", "r2_h1024_w4_cg")
    assert explicit.record() == {"config": "r2_h1024_w4_cg", "config_source": "explicit",
                                 "config_bucket": "T=8,K=2,H=64", "config_gpu": "cpu"}
    # the launcher follows the table (its output does not depend on the launch)
    x = torch.randn(6, 2, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 4], [5, 6], [7, 0]], dtype=torch.int32)
    assert torch.equal(masked_moe_sum(x, ids).view(torch.int16), masked_moe_sum_torch(x, ids).view(torch.int16))


def test_bad_tables_and_names_are_one_line_errors(tables):
    (tables / "cpu.json").write_text("{not json")
    tuning.clear_cache()
    with pytest.raises(ValueError, match="cpu.json: not JSON"):
        sum_choice(6, 2, 64, "cpu")
    _write(tables, {"masked_moe_sum": {"T=8,K=2,H=64": {"config": "r7"}}})
    with pytest.raises(ValueError, match="T=8,K=2,H=64: 'r7' is not one of its candidates"):
        sum_choice(6, 2, 64, "cpu")
    with pytest.raises(ValueError, match="'r7' is not a masked_moe_sum config"):
        sum_choice(6, 2, 64, "cpu", "r7")
    with pytest.raises(ValueError, match="'rule:r1_h64_w1_none' names a launch of masked_moe_sum's rule"):
        sum_choice(6, 2, 72, "cpu", "rule:r1_h64_w1_none")  # what a record of the rule says is no config
    with pytest.raises(ValueError, match="has no launch configs"):
        tuning.candidates("prepare_moe_inputs")
    assert tuning.table_path("NVIDIA H200", tables).name == "NVIDIA_H200.json"
    assert tuning.pow2_bucket(0) == 1 and tuning.pow2_bucket(4097) == 8192


def test_tune_writes_a_table_the_kernels_then_use(tmp_path, tables, capsys):
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SWEEP)
    out = tmp_path / "tuned"
    assert main(["tune", str(sweep), "--out", str(out), "--runs", str(tmp_path / "runs"), "--device", "cpu",
                 "--in-process"]) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "cpu.json").read_text())
    entry = table["kernels"]["masked_moe_sum"]["T=8,K=2,H=64"]
    assert table["format"] == 1 and table["gpu"] == "cpu" and entry["points"] == 2
    assert set(entry["p50_us"]) == set(TWO) and entry["config"] == min(entry["p50_us"], key=entry["p50_us"].get)
    assert "T=8,K=2,H=64" in printed and entry["config"] in printed
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("tiny_tune-masked_moe_sum-")
    assert sorted(r["info"]["config"] for r in load_records(run_dir)) == sorted(TWO * 2)
    # the entry names the versions it was tuned under, from the run's manifest
    assert entry["run"] == str(run_dir)
    assert entry["versions"] == {"triton": triton.__version__, "torch": torch.__version__,
                                 "cuda": torch.version.cuda, "driver": load_manifest(run_dir)["env"].get("driver")}
    # with that table in place, a point that names no config launches the tuned one and records where it came from
    for f in out.iterdir():
        (tables / f.name).write_bytes(f.read_bytes())
    tuning.clear_cache()
    plain = tmp_path / "plain.yaml"
    plain.write_text(SWEEP.replace("name: tiny_tune", "name: plain").replace(f"  config: [{', '.join(TWO)}]\n", ""))
    assert main(["run", str(plain), "--out", str(tmp_path / "plain"), "--device", "cpu", "--no-plots",
                 "--in-process"]) == 0
    capsys.readouterr()
    (plain_dir,) = (tmp_path / "plain").iterdir()
    infos = [r["info"] for r in load_records(plain_dir)]
    assert [(i["config"], i["config_source"]) for i in infos] == [(entry["config"], "table")] * 2
    assert load_manifest(plain_dir)["tuned_tables"] == tuning.tables_digest(tables)
    assert load_manifest(plain_dir)["tuned_tables"]["files"] == ["cpu.json"]


def test_shipped_tables_name_their_runs_and_versions():
    """Every entry of a shipped table names a committed tune run and the versions of that run's manifest."""
    root = Path(__file__).resolve().parents[2]
    for path in sorted(tuning.TABLES_DIR.glob("*.json")):
        for kernel, entries in json.loads(path.read_text())["kernels"].items():
            for bucket, entry in entries.items():
                run = root / entry["run"]
                assert (run / "manifest.json").is_file(), f"{path.name} {kernel} {bucket}: no run {entry['run']}"
                assert entry["versions"] == tuned_with(run), f"{path.name} {kernel} {bucket}"


def test_list_configs_names_every_candidate(capsys):
    assert main(["list", "--configs"]) == 0
    out = capsys.readouterr().out
    for kernel in tuning.tunable_kernels():
        assert f"# {kernel}: rule " in out and " ".join(tuning.candidates(kernel)) in out


def test_tune_refusals_are_one_line_exit_2_nothing_written(tmp_path, tables, capsys):
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SWEEP.replace("r2_h1024_w4_evict_first", "r3_nope"))
    args = ["--out", str(tmp_path / "tuned"), "--runs", str(tmp_path / "runs"), "--device", "cpu"]
    assert main(["tune", str(sweep), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config: 'r3_nope' is not a masked_moe_sum config (one of r1_h512_w1_none" in err[0]
    sweep.write_text(SWEEP.replace("r2_h1024_w4_evict_first", "rule:r1_h64_w1_none"))  # a rule record's name
    assert main(["tune", str(sweep), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config: 'rule:r1_h64_w1_none' names a launch of masked_moe_sum's rule" in err[0]
    assert main(["run", str(sweep), "--out", str(tmp_path / "runs"), "--device", "cpu"]) == 2  # run refuses too
    capsys.readouterr()
    untunable = tmp_path / "torch.yaml"
    untunable.write_text(SWEEP.replace("masked_moe_sum.triton", "masked_moe_sum.torch").replace(
        f"  config: [{', '.join(TWO)}]\n", ""))
    assert main(["tune", str(untunable), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of masked_moe_sum.torch has launch configs to tune" in err[0]
    ok = tmp_path / "ok.yaml"
    ok.write_text(SWEEP)
    package_tables = sorted(tuning.TABLES_DIR.glob("*.json"))
    assert main(["tune", str(ok), "--runs", str(tmp_path / "runs"), "--device", "cpu"]) == 2  # no --out on a CPU
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --out DIR for a CPU table" in err[0]
    assert sorted(tuning.TABLES_DIR.glob("*.json")) == package_tables
    assert not (tmp_path / "tuned").exists() and not (tmp_path / "runs").exists()


SAME_PREFIX = ["r1_h1024_w4_none", "r1_h1024_w4_cg", "r1_h1024_w2_none", "r1_h1024_w8_none"]


def test_tune_tables_print_whole_candidate_names():
    """Four candidates that share their first 7 characters stay four names: in the run table's config column
    (sized from the points to run) and in the table of winners."""
    import io
    from types import SimpleNamespace

    from moebench.report.table import Table
    from moebench.run.tune import choice_lines

    points = [SimpleNamespace(impl="masked_moe_sum.triton", params={"num_tokens": 16, "config": c})
              for c in SAME_PREFIX]
    out = io.StringIO()
    table = Table(["num_tokens", "config"], out=out, points=points)
    table.header()
    for i, c in enumerate(SAME_PREFIX):
        table.row({"point": i, "impl": "masked_moe_sum.triton", "params": {"num_tokens": 16, "config": c},
                   "stats": {"p50": 12.5}, "status": "ok"})
    header, _units, *rows = out.getvalue().splitlines()
    assert [row.split()[3] for row in rows] == SAME_PREFIX
    assert {row.index("12.50") + 5 for row in rows} == {header.index("p50") + 3}  # right-aligned under its title
    picks = {("cpu", f"T=16,K=8,H={h}"): {"config": c, "points": 1,
                                          "p50_us": {c: 10.0, "r2_h1024_w4_evict_first": 11.0}}
             for h, c in zip((64, 128, 256, 512), SAME_PREFIX)}
    lines = choice_lines(picks)
    assert lines[0].split() == ["#", "gpu", "bucket", "config", "p50", "us", "runner-up", "runner-up", "p50", "us"]
    assert {line.split()[1]: line.split()[2] for line in lines[1:]} == {b: p["config"] for (_, b), p in picks.items()}
    assert all(line.split()[4] == "r2_h1024_w4_evict_first" for line in lines[1:])
    assert len({line.index("10.00") for line in lines[1:]}) == 1
