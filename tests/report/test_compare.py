"""`moebench compare RUN_A RUN_B`: noisy points flagged and left out of the geometric means (overall and per impl),
columns as wide as their content, and `0 matching points` explained (exit 2)."""

import json
import re
from pathlib import Path

from moebench.cli import main
from moebench.report.compare import MAX_CV, compare_runs

REPO = Path(__file__).resolve().parents[2]
KERNELS_EXPERTS = REPO / "results/h200/kernels_experts-20261202T064435Z"
STRAGGLER = REPO / "results/h200/scenarios/sp_padding_straggler-20261201T103951Z"
LONG_IMPL = "fused_experts.torch_grouped_compiled"


def _rec(key, impl, p50, cv, **params):
    return {"key": key, "impl": impl, "status": "ok", "params": params, "stats": {"p50": p50, "cv": cv}}


def _write_run(path, records, name="x", axes=("padding_ratio",)):
    path.mkdir(parents=True)
    sweep = {"name": name, "target": "kernel", "axes": {k: [] for k in axes}}
    (path / "manifest.json").write_text(json.dumps({"sweep": sweep}))
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _two_runs(tmp_path):
    a = _write_run(tmp_path / "a", [_rec("k1", "i.triton", 10.0, 0.01, padding_ratio=0.0),
                                    _rec("k2", "i.triton", 10.0, 0.02, padding_ratio=0.5),
                                    _rec("k3", LONG_IMPL, 10.0, 0.01, padding_ratio=0.0)])
    b = _write_run(tmp_path / "b", [_rec("k1", "i.triton", 20.0, 0.03, padding_ratio=0.0),
                                    _rec("k2", "i.triton", 1003.48, 1.79, padding_ratio=0.5),  # cv 179%
                                    _rec("k3", LONG_IMPL, 5.0, 0.01, padding_ratio=0.0)])
    return a, b


def test_a_noisy_point_is_flagged_and_left_out_of_the_geometric_means(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    assert compare_runs(a, b) == 0
    out = capsys.readouterr().out
    (noisy,) = [line for line in out.splitlines() if "100.348" in line]
    assert noisy.split()[-1] == "noisy" and "179.0" in noisy
    assert f"cv above {100 * MAX_CV:g}%" in out.splitlines()[0]
    # 2.0 and 0.5 kept: geomean 1.0; the noisy 100.348 would have made it 4.6
    assert "# geometric mean B/A: 1.000 over 2 points (1 noisy point left out: cv above 10%)" in out
    per_impl = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")
                and len(line.split()) == 4}
    assert per_impl["i.triton"] == ["2.000", "1", "1"] and per_impl[LONG_IMPL] == ["0.500", "1", "0"]
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--max-cv", "200"]) == 0  # a higher threshold keeps the point
    assert "over 3 points" in capsys.readouterr().out


def test_compare_columns_fit_their_content(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    compare_runs(a, b)
    lines = capsys.readouterr().out.splitlines()
    assert "padding_ratio" in lines[1].split() and any(LONG_IMPL in line.split() for line in lines)
    header, rows = lines[1], lines[2:5]
    assert header.startswith("# impl") and all(row.startswith("  ") for row in rows)
    flags = re.compile(r"\s+(noisy|outside spread)(, (noisy|outside spread))*$")  # the flag column, when set
    ratios = [flags.sub("", row).split()[-1] for row in rows]
    ends = {header.index("B/A") + 3} | {row.rfind(r) + len(r) for row, r in zip(rows, ratios)}
    assert len(ends) == 1  # the ratio column ends at the same place on the header and every row


def test_no_matching_points_says_what_differs_and_exits_2(capsys):
    code = main(["compare", str(STRAGGLER), str(KERNELS_EXPERTS)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    err = captured.err.splitlines()
    assert err[0].startswith("moebench: compare: 0 matching points between")
    body = "\n".join(err[1:])
    for want in ("sweep name: A sp_padding_straggler, B kernels_experts", "sweep target: A layer, B kernel",
                 "impls: only in A: ep_sim.experts", "only in B: fused_experts.ceiling",
                 "parameter keys only in B: config", "num_tokens: A 2048; B 128, 4096, 8192"):
        assert want in body, want
    assert all(line.startswith("  ") for line in err[1:])


def test_no_ok_point_in_common_is_explained_too(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    failed = [dict(json.loads(line), status="failed") for line in (b / "records.jsonl").read_text().splitlines()]
    (b / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in failed))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "3 points are in both runs, none ok in both: B's statuses there failed 3" in err


def test_bad_max_cv_is_one_line_exit_2(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    for bad in ("ten", "0", "-5"):
        assert main(["compare", str(a), str(b), "--max-cv", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--max-cv" in err[0]
