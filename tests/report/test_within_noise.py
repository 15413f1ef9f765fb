"""`within noise` everywhere a figure is inside the timings' noise (headlines in the footer and on the report page,
compare), and a masked/oblivious pair that is not comparable, or two sides that ran the same steps, named instead of
a ratio that would read as a saving."""

import io
import json

from moebench.report import headline
from moebench.report.compare import compare_runs
from moebench.report.page import headline_table, load_run

TAX = {"label": "padding tax", "metric": "info.headline.padding_tax.oblivious",
       "with_metric": "info.headline.padding_tax.masked", "reduce": "max", "without": {"capture_sizes": "default"},
       "with": {"capture_sizes": "default"}, "without_label": "oblivious", "with_label": "masked"}
RECOVERED = {"label": "masks recover (us)", "metric": "info.headline.layer_us.oblivious",
             "with_metric": "info.headline.layer_us.masked", "reduce": "max",
             "without": {"capture_sizes": "dense"}, "with": {"capture_sizes": "dense"}}
LISTS = {"label": "tax, pow2 vs default", "metric": "info.headline.padding_tax.oblivious", "reduce": "max",
         "without": {"capture_sizes": "pow2"}, "with": {"capture_sizes": "default"}}


def _rec(capture_sizes, *, tax=(0.05, 0.02), within=None, real=(1000.0, 1000.0), steps=None):
    oblivious, masked = tax
    head = {"padding_tax": {"oblivious": oblivious, "masked": masked},
            "layer_us": {"oblivious": real[1] * (1 + oblivious), "masked": real[0] * (1 + masked)},
            "real_only_us": {"masked": real[0], "oblivious": real[1]},
            "noise": {"recovered_us": None, "within_noise": {"padding_tax": {"oblivious": within, "masked": within},
                                                             "recovered": within}}}
    return {"point": 0, "impl": "serving_trace.layer", "status": "ok", "target": "serving_trace",
            "params": {"capture_sizes": capture_sizes},
            "info": {"headline": head, "trace_steps": steps or [{"step": 0, "real": [3, 3], "rows": 8}]}}


def test_a_tax_inside_the_noise_says_so_and_gets_no_ratio(tmp_path):
    (row,) = headline.evaluate([_rec("default", within=True)], [TAX])
    text = headline.line(row)
    assert text == "padding tax: oblivious 0.05 (within noise) | masked 0.02 (within noise)"
    assert "2.5x" not in text
    (row,) = headline.evaluate([_rec("default", within=False)], [TAX])
    assert headline.line(row) == "padding tax: oblivious 0.05 | masked 0.02 (2.5x)"
    # the report page says the same
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"sweep": {"name": "t", "target": "serving_trace",
                                                             "headlines": [TAX]}}))
    (run / "records.jsonl").write_text(json.dumps(_rec("default", within=True)) + "\n")
    _, rows = headline_table(load_run(run))
    assert rows[0][1] == "oblivious: 0.05 (within noise)" and rows[0][3] == "within noise"


def test_masked_slower_on_the_real_rows_is_not_comparable():
    """The dense list pads no row, yet the masked layer is slower: no "recovered" saving, no tax ratio."""
    rec = _rec("dense", tax=(0.0, 0.0), real=(2375.0, 1790.0))
    (row,) = headline.evaluate([rec], [RECOVERED])
    assert row.change == "not comparable: the masked layer is slower on the real rows alone (2.38 vs 1.79 ms)"
    assert "x)" not in headline.line(row)
    (row,) = headline.evaluate([_rec("dense", real=(1010.0, 1000.0))], [RECOVERED])
    assert row.change.endswith("x")  # 1% slower, noise unknown: within the 5% slack, a ratio


def test_two_sides_that_ran_the_same_steps_are_no_comparison():
    # the same rows, the seeded routing elsewhere (another slowest rank): still the same steps
    same = [_rec("pow2", tax=(0.04, 0.0), steps=[{"step": 0, "real": [3, 3], "rows": 8, "ep_slowest_rank": 0}]),
            _rec("default", tax=(0.05, 0.0), steps=[{"step": 0, "real": [3, 3], "rows": 8, "ep_slowest_rank": 3}])]
    (row,) = headline.evaluate(same, [LISTS])
    assert row.change == "no comparison: both sides ran the same trace steps at this size"
    counted = [_rec("pow2"), _rec("default")]  # a family that keeps a count of steps, not the steps
    for r in counted:
        r["info"]["trace_steps"] = 3
    (row,) = headline.evaluate(counted, [LISTS])
    assert row.change.endswith("x")
    other = [_rec("pow2", steps=[{"step": 0, "real": [3, 3], "rows": 16}]), _rec("default")]
    (row,) = headline.evaluate(other, [LISTS])
    assert row.change.endswith("x")


def _run(path, p50, cv):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"sweep": {"name": "x", "axes": {"num_tokens": [1]}}}))
    rec = {"key": "k", "impl": "i.triton", "status": "ok", "params": {"num_tokens": 1}, "stats": {"p50": p50, "cv": cv}}
    (path / "records.jsonl").write_text(json.dumps(rec) + "\n")
    return path


def test_compare_marks_a_ratio_inside_the_points_spread(tmp_path):
    out = io.StringIO()
    compare_runs(_run(tmp_path / "a", 100.0, 0.05), _run(tmp_path / "b", 103.0, 0.04), out=out)
    (row,) = [line for line in out.getvalue().splitlines() if "i.triton" in line]
    assert row.endswith("within noise")
    out = io.StringIO()
    compare_runs(_run(tmp_path / "c", 100.0, 0.01), _run(tmp_path / "d", 130.0, 0.01), out=out)
    (row,) = [line for line in out.getvalue().splitlines() if "i.triton" in line]
    assert "within noise" not in row
