"""The capture lists of a run ranked by the deployed side's step time, never a share: the EP step where there is EP,
else the layer; each figure with its model's error; `within noise` where the difference is inside the errors; no
ranking where a figure is unchecked or the sides are not comparable."""

from __future__ import annotations

from moebench.report import trace_tax
from moebench.report.ranking import rankings

PARAMS = {"dp_size": 2, "sp_size": 1, "dbo": False, "ep_size": 8, "num_experts": 64, "top_k": 4}


def _record(capture_list, step_us, layer_us, *, held=0.01, tax=None, real_only=None, ep=True, shape_mode="exact",
            sp_size=2):
    """A serving_trace record as the family writes it, cut to what the ranking reads. SP 2 by default: its chunks
    are cut at the padded size, so the masked EP step's work may differ between lists."""
    real_only = real_only or {"masked": 900.0, "oblivious": 900.0}
    head = {"layer_us": layer_us, "real_only_us": real_only,
            "padding_us": {s: layer_us[s] - real_only[s] for s in layer_us},
            "padding_tax": tax or {s: (layer_us[s] - real_only[s]) / layer_us[s] for s in layer_us},
            "recovered_us": layer_us["oblivious"] - layer_us["masked"], "recovered_share": None,
            "padded_rows": 10, "real_tokens": 100, "padding_gemm_rows": {"masked": 0, "oblivious": 4},
            "jit_compiles": {"masked": 1, "oblivious": 1}}
    info = {"engine": {"capture_list": capture_list, "dp_size": 2, "sp_size": sp_size, "dbo": False, "ep_size": 8},
            "trace": {"steps": 1000}, "distinct_shapes": 10, "headline": head,
            "shape_plan": {"shape_times": shape_mode}}
    if ep:
        split = {"gemm_us": 1.0, "straggler_us": 2.0, "wire_us": 3.0, "overlap_us": 0.0, "total_us": 6.0}
        head["ep_step"] = {"step_us": step_us, "tax_split_us": split, "padding_tax": 0.1}
        info["ep_step"] = {"rank_times": "model", "cost_model": {"held_out": {"rms_rel": held}},
                           "wire": {"kind": "model", "name": "test"}}
    return {"target": "serving_trace", "status": "ok",
            "params": {**PARAMS, "sp_size": sp_size, "capture_sizes": capture_list},
            "info": info}


def _words(rk):
    return {f.capture_list: word for f, word in rk.verdicts()}


def test_the_ep_step_of_the_deployed_side_ranks_in_time_with_the_models_error():
    recs = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0}),
            _record("pow2", {"masked": 1005.0, "oblivious": 1100.0}, {"masked": 1.0, "oblivious": 1.0}),
            _record("fine", {"masked": 1100.0, "oblivious": 1250.0}, {"masked": 1.0, "oblivious": 1.0})]
    masked, oblivious = rankings(recs, lambda r: "DP 2")
    assert masked.side == "masked" and masked.what == "EP step" and masked.refused is None
    assert [f.capture_list for f in masked.figures] == ["default", "pow2", "fine"]
    words = _words(masked)
    assert words["default"].startswith("fastest (±1.0% the rank model's held-out error")
    assert words["pow2"].startswith("within noise")  # 5 us apart, 20 us of error
    assert words["fine"].startswith("+10.0%")
    assert [f.capture_list for f in oblivious.figures] == ["pow2", "fine", "default"]  # its own order
    line = masked.line()
    assert line.startswith("fastest masked EP step (DP 2): default 1.00 ms fastest")


def test_an_unchecked_model_or_sides_not_comparable_are_not_ranked():
    unchecked = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0}),
                 _record("pow2", {"masked": 900.0, "oblivious": 1100.0}, {"masked": 1.0, "oblivious": 1.0},
                         held=None)]
    (rk, _) = rankings(unchecked, lambda r: "DP 2")
    assert rk.refused == "pow2: the rank model's error unchecked (every timing went to its design)"
    assert rk.verdicts() == [] and "not ranked" in rk.line()
    # the single-rank view (no EP step) ranks each side's lists, also where the two sides are not comparable
    # (that is the tax's concern): every shape timed, so both lists' layers are their timings, whose spread (the
    # headline's noise bound) is their error
    slow = {"masked": 1500.0, "oblivious": 900.0}
    layer = [_record("default", None, {"masked": 2000.0, "oblivious": 2100.0}, ep=False),
             _record("pow2", None, {"masked": 1900.0, "oblivious": 2300.0}, ep=False, real_only=slow)]
    for r in layer:
        r["info"]["headline"]["noise"] = {"recovered_us": 10.0}
    (rk, _) = rankings(layer, lambda r: "DP 2")
    assert rk.what == "single-rank layer" and rk.refused is None
    assert [f.capture_list for f in rk.figures] == ["pow2", "default"]
    assert _words(rk)["pow2"].startswith("fastest (±0.5% the timings' spread")
    # a spread 20 times wider makes the two lists one within the other's noise
    for r in layer:
        r["info"]["headline"]["noise"] = {"recovered_us": 200.0}
    (rk, _) = rankings(layer, lambda r: "DP 2")
    assert _words(rk)["default"].startswith("within noise")
    # timed with too few samples to tell a spread (the interpreter's): not ranked, and why
    for r in layer:
        del r["info"]["headline"]["noise"]
    (rk, _) = rankings(layer, lambda r: "DP 2")
    assert rk.refused == "default: timed, its noise unknown (fewer than 5 samples a shape)"


def test_the_runs_footer_and_table_rank_the_lists_it_was_given():
    recs = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1500.0, "oblivious": 1600.0}),
            _record("pow2", {"masked": 1200.0, "oblivious": 1250.0}, {"masked": 1400.0, "oblivious": 1700.0})]
    footer = trace_tax.footer_lines(recs)
    assert any(line.strip().startswith("fastest masked EP step") and "pow2 1.20 ms +20.0%" in line
               for line in footer), footer
    assert not any("least tax" in line for line in footer)
    head, rows = trace_tax.table(recs)
    col = head.index("masked step vs the fastest list")
    assert rows[0][col].startswith("fastest") and rows[1][col].startswith("+20.0%")


def test_compare_of_two_trace_runs_diffs_their_answers_with_the_models_error():
    from moebench.report import trace_compare

    def keyed(r):
        return {**r, "key": "k-" + r["info"]["engine"]["capture_list"]}

    a = [keyed(_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1500.0, "oblivious": 1600.0}))]
    b = [keyed(_record("default", {"masked": 1010.0, "oblivious": 1500.0}, {"masked": 1500.0, "oblivious": 1600.0},
                       held=0.02))]
    rows = trace_compare.rows(a, b)
    by = {(r[1], r[2]): r for r in rows}
    assert set(by) == {("EP step", "masked"), ("EP step", "oblivious"), ("layer", "masked"), ("layer", "oblivious")}
    assert by[("EP step", "masked")][-1] == "within the errors"  # 10 us apart, 30 us of error
    assert by[("EP step", "oblivious")][-1] == "changed" and by[("EP step", "oblivious")][7] == "1.154"
    assert by[("EP step", "masked")][4] == "1.0%" and by[("EP step", "masked")][6] == "2.0%"
    # every shape timed, the timings' noise unknown (the interpreter's one sample a shape): not judged
    assert by[("layer", "masked")][-1].startswith("not judged: timed, its noise unknown")
    for r in a + b:  # a known noise bound: the layer's difference judged against it
        r["info"]["headline"]["noise"] = {"recovered_us": 30.0}
    assert {r[2]: r[-1] for r in trace_compare.rows(a, b) if r[1] == "layer"} == {"masked": "within the errors",
                                                                                "oblivious": "within the errors"}
    b[0]["info"]["ep_step"]["cost_model"]["held_out"]["rms_rel"] = None
    assert trace_compare.rows(a, b)[0][-1].startswith("not judged: the rank model's error unchecked")
    assert trace_compare.lines(a, []) == []


def test_the_plots_carry_the_models_word_and_draw_no_bar_for_sides_not_comparable(tmp_path, monkeypatch):
    from moebench.plots import trace as trace_plots
    from moebench.plots.common import Run

    slow = {"masked": 1500.0, "oblivious": 900.0}
    recs = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 2000.0, "oblivious": 2100.0}),
            _record("pow2", {"masked": 900.0, "oblivious": 1100.0}, {"masked": 2000.0, "oblivious": 2300.0},
                    real_only=slow, held=None)]
    for r in recs:
        r["info"]["headline"]["ep_step"].update(mean_rank_us={"masked": 1.0, "oblivious": 1.0},
                                                straggler_wait_us={"masked": 1.0, "oblivious": 1.0},
                                                dispatch_us={"masked": 1.0, "oblivious": 1.0},
                                                combine_us={"masked": 1.0, "oblivious": 1.0})
    figures = []
    monkeypatch.setattr(trace_plots, "save", lambda fig, path, title: figures.append(fig))
    run = Run(tmp_path, "run", {"sweep": {"name": "padding_tax"}}, recs)
    trace_plots.trace_tax(run, tmp_path)
    ax = figures[-1].axes[0]
    assert len(ax.patches) == 2  # default's two sides; pow2 (masked slower on the real rows alone): none
    assert any(t.get_text() == "not comparable" for t in ax.texts)
    assert [t.get_text().split("\n")[1] for t in ax.get_xticklabels()] == ["timed | timed", "timed | timed"]
    before = len(figures)
    trace_plots.ep_step_bars(run, tmp_path)  # a figure a capture list, a word above each bar
    words = [t.get_text() for fig in figures[before:] for t in fig.axes[0].texts]
    assert sorted(set(words)) == ["unchecked", "±1.0%"] and len(words) == 4


def test_masked_ep_steps_that_should_agree_and_do_not_are_not_ranked():
    """Without SP or DBO the masked EP step does the same work under every list: lists that differ beyond their
    stated errors are noise, refused with the figures; lists within them are ranked."""
    apart = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0},
                     sp_size=1),
             _record("pow2", {"masked": 1050.0, "oblivious": 1100.0}, {"masked": 1.0, "oblivious": 1.0},
                     sp_size=1)]
    masked, oblivious = rankings(apart, lambda r: "DP 2")
    assert masked.refused.startswith("the masked EP step does the same work under every list, yet pow2's is 5.0% "
                                     "above default's, beyond the errors stated (±1.0%, ±1.0%)")
    assert oblivious.refused is None and oblivious.figures[0].capture_list == "pow2"
    close = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0},
                     sp_size=1),
             _record("pow2", {"masked": 1015.0, "oblivious": 1100.0}, {"masked": 1.0, "oblivious": 1.0},
                     sp_size=1)]
    masked, _ = rankings(close, lambda r: "DP 2")
    assert masked.refused is None and _words(masked)["pow2"].startswith("within noise")


def test_an_ep_replay_that_differs_more_than_the_model_says_is_the_figures_error():
    """The EP replay times its steps' every rank afresh: where it differs from the composition by more than the
    model's held-out error, that difference is the figure's error (per side), and an unchecked model is checked."""
    replay = {"steps": 2, "composed": {}, "replayed": {}, "tolerance": 0.03, "wall_s": 1.0,
              "rel_diff": {"masked": {"experts_us": 0.05, "step_us": 0.24}, "oblivious": {"step_us": 0.01}},
              "within_tolerance": {"masked": False, "oblivious": True}}
    recs = [_record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0}),
            _record("pow2", {"masked": 1150.0, "oblivious": 1100.0}, {"masked": 1.0, "oblivious": 1.0},
                    held=None)]
    recs[1]["info"]["ep_step"]["replay"] = replay
    masked, oblivious = rankings(recs, lambda r: "DP 2")
    assert masked.refused is None and oblivious.refused is None
    words = _words(masked)
    assert "within noise" in words["pow2"] and "24.0% the EP replay's difference (2 steps" in words["pow2"]
    assert "1.0% the EP replay's difference" in _words(oblivious)["pow2"]


def test_a_headline_on_the_ep_step_carries_the_models_word():
    from moebench.report.headline import evaluate, lines

    spec = {"label": "EP step", "metric": "info.headline.ep_step.step_us.oblivious",
            "with_metric": "info.headline.ep_step.step_us.masked", "reduce": "max",
            "without": {"capture_sizes": "default"}, "with": {"capture_sizes": "default"}}
    for held, word in ((0.048, "±4.8% model"), (None, "model unchecked")):
        rec = _record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0},
                      held=held)
        (row,) = evaluate([rec], [spec])
        assert row.model_without == row.model_with == word
        assert lines([row])[0] == f"EP step: without 1300 ({word}) | with 1000 ({word}) (1.3x)"
    timed = _record("default", {"masked": 1000.0, "oblivious": 1300.0}, {"masked": 1.0, "oblivious": 1.0})
    timed["info"]["ep_step"]["rank_times"] = "timed"
    (row,) = evaluate([timed], [spec])
    assert row.model_without == "" and "(" not in lines([row])[0].split("|")[0]
