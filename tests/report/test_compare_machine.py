"""`moebench compare` notices the machine: both runs' references (a fixed matmul and a copy at each run's start and
end) are printed, a geometric mean no larger than the machines' difference is not called a speed-up, and a ratio far
outside both runs' spread is flagged. A run records its references in its manifest."""

import io
import json
from pathlib import Path

from moebench.records import load_manifest
from moebench.report.compare import compare_runs
from moebench.run.runner import run_sweep
from moebench.run.sweep import load_sweep

QUICKSTART = Path(__file__).resolve().parents[2] / "sweeps" / "quickstart.yaml"


def _ref(matmul, copy):
    return {"matmul_us": matmul, "copy_us": copy, "workload": "fp32 matmul 192x192x192; copy of 8 MiB"}


def _run(path, p50s, cvs, references):
    path.mkdir(parents=True)
    manifest = {"sweep": {"name": "quickstart", "axes": {"num_tokens": [64, 512]}}}
    if references is not None:
        manifest["machine_reference"] = {"start": references[0], "end": references[1]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    records = [{"key": f"k{i}", "impl": "topk_softmax.torch", "status": "ok", "params": {"num_tokens": 64 * (i + 1)},
                "stats": {"p50": p50, "cv": cv}} for i, (p50, cv) in enumerate(zip(p50s, cvs))]
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _compare(tmp_path, refs_a, refs_b, ratio=0.342):
    a = _run(tmp_path / "a", [100.0, 200.0], [0.007, 0.05], refs_a)
    b = _run(tmp_path / "b", [100.0 * ratio, 200.0 * ratio], [0.099, 0.02], refs_b)
    out = io.StringIO()
    assert compare_runs(a, b, out=out) == 0
    return out.getvalue()


def test_a_disturbed_run_s_reference_stops_the_speed_up_being_called(tmp_path):
    quiet = (_ref(130.0, 160.0), _ref(132.0, 158.0))
    slowed = (_ref(1100.0, 1400.0), _ref(1050.0, 1300.0))  # something else loaded the machine of run A
    text = _compare(tmp_path, slowed, quiet)
    assert "# machine reference A: start matmul 1100 us, copy 1400 us; end matmul 1050 us, copy 1300 us" in text
    assert "# machine reference B: start matmul 130 us" in text
    assert "# geometric mean B/A: 0.342 over 2 points" in text
    assert "NOT a speed-up or slow-down: the machines' references differ by" in text


def test_a_run_whose_machine_changed_under_it_is_caught_by_its_own_drift(tmp_path):
    drifting = (_ref(130.0, 160.0), _ref(600.0, 700.0))
    text = _compare(tmp_path, (_ref(130.0, 160.0), _ref(131.0, 161.0)), drifting)
    assert "NOT a speed-up or slow-down" in text


def test_alike_machines_let_the_result_stand_and_an_outlier_is_flagged(tmp_path):
    quiet = (_ref(130.0, 160.0), _ref(132.0, 158.0))
    text = _compare(tmp_path, quiet, (_ref(131.0, 159.0), _ref(129.0, 161.0)))
    assert "NOT a speed-up" not in text and "geometric mean B/A: 0.342" in text
    rows = [line for line in text.splitlines() if "topk_softmax.torch" in line]
    assert len(rows) == 2 and all(line.endswith("outside spread") for line in rows)  # 2.9x at cv 0.7 to 9.9%
    text = _compare(tmp_path / "near", quiet, quiet, ratio=1.05)
    assert "outside spread" not in text


def test_runs_without_references_say_it_is_unknown(tmp_path):
    text = _compare(tmp_path, None, None)
    assert "machine reference A: not recorded" in text and "whether the machines differed is unknown" in text


def test_a_run_records_its_machine_reference_at_start_and_end(tmp_path):
    sweep = load_sweep(QUICKSTART, ["axes.num_tokens=[64]", "axes.padding_ratio=[0.0]", "axes.mask=[true]",
                                    "impls=[topk_softmax.torch]", "timing.iters=1", "timing.warmup=0"])
    _, run_dir = run_sweep(sweep, out_base=tmp_path, device="cpu", out=io.StringIO(), isolate=False)
    refs = load_manifest(run_dir)["machine_reference"]
    for when in ("start", "end"):
        assert refs[when]["matmul_us"] > 0 and refs[when]["copy_us"] > 0 and refs[when]["device"] == "cpu"
