"""The consistency pass over each record before it is written: a total that is not the sum of its parts, or a
share outside [0, 1], makes the point wrong, naming the figure; a record of today's serving_trace passes."""

import copy
import io
import json
from pathlib import Path

import pytest

from moebench import consistency, registry
from moebench.run import runner
from moebench.run.results import load_records
from moebench.run.sweep import load_sweep

registry.load_all()  # the families register their checks at import (serving_trace: moebench.bench.serving_trace.checks)


def _trace_record(dbo=False):
    """The figures of a serving_trace record as the family writes them (a CPU run's, rounded as stored)."""
    head = {
        "layer_us": {"masked": 2021816.768, "oblivious": 1453902.486},
        "real_only_us": {"masked": 1768311.212, "oblivious": 1504953.92},
        "padding_us": {"masked": 253505.556, "oblivious": -51051.434},
        "recovered_us": -567914.282, "real_tokens": 18, "padded_rows": 8, "padding_row_share": 0.3077,
        "padding_gemm_rows": {"masked": 0, "oblivious": 2}, "ep_excess_routes": {"masked": 6.0, "oblivious": 12.0},
        "jit_compiles": {"masked": 3, "oblivious": 3},
        "ep_step": {"step_us": {"masked": 1021185.0, "oblivious": 1136552.42},
                    "tax_split_us": {"gemm_us": 76911.611, "straggler_us": 38455.806, "wire_us": 0.003,
                                     "overlap_us": 0.0, "total_us": 115367.42},
                    "slowest_rank_padded_route_share": 0.375}}
    head["padding_tax"] = {s: head["padding_us"][s] / head["layer_us"][s] for s in ("masked", "oblivious")}
    totals = {"masked": {"step_us": 1021185.0, "experts_us": 1019988.0, "mean_rank_us": 990000.0,
                         "dispatch_us": 672.0, "combine_us": 525.0},
              "oblivious": {"step_us": 1136552.42, "experts_us": 1135355.42, "mean_rank_us": 1066911.611,
                            "dispatch_us": 672.003, "combine_us": 524.997}}
    return {"point": 0, "target": "serving_trace", "status": "ok", "reason": "",
            "stats": {"n": 3, "p50": 2.0, "p10": 1.0, "p90": 3.0, "min": 1.0, "max": 3.0, "cv": 0.1},
            "info": {"engine": {"dbo": dbo}, "headline": head, "ep_step": {"totals": totals}}}


def test_a_consistent_record_passes_unchanged():
    rec = _trace_record()
    assert consistency.problems(rec) == []
    assert consistency.vet(copy.deepcopy(rec)) == rec


@pytest.mark.parametrize("path, value, named", [
    ("info.headline.layer_us.masked", 2000000.0, "info.headline.layer_us.masked: 2000000.0 != real_only_us"),
    ("info.headline.padding_row_share", 1.3, "info.headline.padding_row_share: 1.3 is not a share"),
    ("info.headline.ep_step.tax_split_us.gemm_us", 80000.0, "tax_split_us.total_us: 115367.42 != gemm + straggler"),
    ("info.headline.padding_gemm_rows.oblivious", -1, "padding_gemm_rows.oblivious: -1 is negative"),
    ("info.headline.recovered_us", 567914.282, "recovered_us: 567914.282 != layer_us oblivious - masked"),
    ("info.ep_step.totals.masked.step_us", 1.0, "totals.masked.step_us: 1.0 != experts + dispatch + combine"),
    ("stats.p10", 2.5, "stats.p10: 2.5 above stats.p50 2.0"),
])
def test_an_inconsistent_figure_makes_the_point_wrong_naming_it(path, value, named):
    rec = _trace_record()
    node = rec
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    consistency.vet(rec)
    assert rec["status"] == "wrong" and rec["reason"].startswith("inconsistent figures: ")
    assert any(named in p for p in rec["consistency"]), rec["consistency"]


def test_no_padded_row_means_no_time_on_padding():
    rec = _trace_record()
    rec["info"]["headline"]["padded_rows"] = 0
    found = consistency.problems(rec)
    assert any(p.startswith("info.headline.padding_us.masked: 253505.556 with no padded row") for p in found)


def test_a_record_that_is_not_ok_is_left_alone():
    rec = _trace_record()
    rec["info"]["headline"]["layer_us"]["masked"] = 0.0
    rec.update(status="failed", reason="worker died")
    assert consistency.vet(rec)["status"] == "failed" and "consistency" not in rec


def test_the_runner_vets_each_record_before_writing_it(tmp_path, monkeypatch):
    """A check that finds a problem: the written record is wrong naming it, and the run exits 1."""
    checks = dict(consistency._CHECKS)
    monkeypatch.setattr(consistency, "_CHECKS", {k: list(v) for k, v in checks.items()})
    consistency.register_check("router")(lambda rec: ["info.made_up: 2 != 1 + 0"])
    sweep_file = Path(__file__).resolve().parents[2] / "sweeps" / "quickstart.yaml"
    sweep = load_sweep(sweep_file, ["axes.num_tokens=[64]", "axes.padding_ratio=[0.5]", "axes.mask=[true]",
                                    "impls=[topk_softmax.torch]", "timing.iters=1", "timing.warmup=0"])
    code, run_dir = runner.run_sweep(sweep, out_base=tmp_path, device="cpu", out=io.StringIO(), isolate=False)
    (rec,) = load_records(run_dir)
    assert code == 1 and rec["status"] == "wrong"
    assert rec["reason"] == "inconsistent figures: info.made_up: 2 != 1 + 0"
    assert json.loads((Path(run_dir) / "records.jsonl").read_text().splitlines()[0])["consistency"]


def test_without_dbo_the_overlap_is_the_rounding_of_the_trace_sums_and_no_more():
    """Over 200,000 steps the tax split's residual is the float sums' rounding (~1e-12 of the steps' sums): it
    passes; an overlap of real size without DBO does not."""
    rec = _trace_record()
    split = rec["info"]["headline"]["ep_step"]["tax_split_us"]
    rec["info"]["headline"]["ep_step"]["step_us"] = {"masked": 3.4e9, "oblivious": 3.4e9 + 115367.42}
    for side, t in rec["info"]["ep_step"]["totals"].items():
        t["step_us"] = rec["info"]["headline"]["ep_step"]["step_us"][side]
        t["experts_us"] = t["step_us"] - t["dispatch_us"] - t["combine_us"]
    split["overlap_us"], split["gemm_us"] = 0.005, split["gemm_us"] - 0.005
    assert consistency.problems(rec) == []
    split["overlap_us"], split["gemm_us"] = 50.0, split["gemm_us"] - 49.995
    assert any("overlap_us: 50.0 without DBO" in p for p in consistency.problems(rec))
