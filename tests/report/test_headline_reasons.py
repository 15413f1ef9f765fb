"""A headline that cannot be computed says why in one line (never a bare n/a), in the footer and on the page."""

from moebench.report import headline


def _rec(point, capture_sizes, tax, status="ok"):
    info = {"headline": {"padding_tax": {"oblivious": tax, "masked": tax / 2}}} if tax is not None else {}
    return {"point": point, "impl": "serving_trace.layer", "status": status,
            "params": {"capture_sizes": capture_sizes}, "info": info}


SPEC = {"label": "padding tax, default capture list", "metric": "info.headline.padding_tax.oblivious",
        "with_metric": "info.headline.padding_tax.masked", "reduce": "max",
        "without": {"capture_sizes": "default"}, "with": {"capture_sizes": "default"},
        "without_label": "oblivious", "with_label": "masked"}
VERSUS = {"label": "padding tax, pow2 vs default", "metric": "info.headline.padding_tax.oblivious", "reduce": "max",
          "without": {"capture_sizes": "pow2"}, "with": {"capture_sizes": "default"},
          "without_label": "pow2", "with_label": "default"}


def test_a_selector_no_point_matches_names_the_value_and_what_the_run_has():
    records = [_rec(0, "pow2", 0.1), _rec(1, "dense", 0.0)]
    both, versus = headline.evaluate(records, [SPEC, VERSUS])
    assert headline.line(both) == ("padding tax, default capture list: not in this run: no point has "
                                   "capture_sizes=default (it has pow2, dense)")
    text = headline.line(versus)
    assert text.startswith("padding tax, pow2 vs default: pow2 0.1 | default n/a (not in this run: no point has "
                           "capture_sizes=default (it has pow2, dense))"), text
    assert "n/a |" not in text.replace("n/a (", "")


def test_selected_points_without_the_metric_say_so():
    (row,) = headline.evaluate([_rec(0, "default", None, status="failed")], [SPEC])
    assert headline.line(row).endswith("not recorded: the 1 selected point(s) are failed")
    (row,) = headline.evaluate([_rec(0, "default", None)], [SPEC])
    assert "not recorded: info.headline.padding_tax.oblivious is in none of the 1 selected point(s)" in \
        headline.line(row)


def test_a_computed_headline_is_unchanged():
    (row,) = headline.evaluate([_rec(0, "default", 0.2)], [SPEC])
    assert headline.line(row) == "padding tax, default capture list: oblivious 0.2 | masked 0.1 (2x)"
    assert row.why_without == row.why_with == ""


def test_a_headline_reads_in_its_unit_as_the_footer_does():
    step = {"label": "EP step over the trace", "metric": "info.headline.ep_step.step_us.oblivious",
            "with_metric": "info.headline.ep_step.step_us.masked", "reduce": "max", "unit": "ms",
            "without": {"capture_sizes": "default"}, "with": {"capture_sizes": "default"},
            "without_label": "oblivious", "with_label": "masked"}
    rec = _rec(0, "default", 0.02988)
    rec["info"]["headline"]["ep_step"] = {"step_us": {"oblivious": 973755.123, "masked": 894363.0}}
    ms, share = headline.evaluate([rec], [step, {**SPEC, "unit": "%"}])
    assert headline.line(ms) == "EP step over the trace: oblivious 973.76 ms | masked 894.36 ms (1.09x)"
    assert headline.line(share) == "padding tax, default capture list: oblivious 3.0% | masked 1.5% (2x)"
    assert headline.side_text(None, "not recorded: x", unit="ms") == "n/a (not recorded: x)"
    assert headline.spec_problem({**SPEC, "unit": "us"}, ["capture_sizes"], []) == "unit: 'us' is not one of ms, %"


def test_the_trace_scenarios_headlines_of_times_and_shares_declare_their_unit():
    from moebench.run.paths import bundled_sweeps
    from moebench.run.sweep import load_sweep

    checked = 0
    for path in bundled_sweeps():
        if path.stem not in ("padding_tax", "sp_padding_prefill"):
            continue
        for spec in load_sweep(path).headlines:
            leaf = spec["metric"].split(".")
            want = "ms" if any(p.endswith("_us") for p in leaf) else "%" if "padding_tax" in leaf else None
            assert spec.get("unit") == want, (path.name, spec["label"])
            checked += want is not None
    assert checked == 8
