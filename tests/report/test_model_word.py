"""The report page's serving-trace tables give every figure that rests on a cost model that model's word, as the
footer, the ranking and the plots do (report.ranking.error_word): the EP step's figures the rank model's held-out
error (`±1.8%`) or `unchecked`, the layer's figures the shape model's per side; a figure read off timings stays
bare, and the wire's figures rest on the wire model, not the rank model. A layer pair the run calls not comparable
is flagged on its layer cells as on its tax."""

from __future__ import annotations

import json

from moebench.report import noise, trace_tax
from moebench.report.page import write_report
from moebench.report.ranking import error_word

SIDES2 = ("oblivious", "masked")
PARAMS = {"dp_size": 2, "sp_size": 1, "dbo": False, "ep_size": 8, "capture_sizes": "default"}


def _sides(oblivious: float, masked: float) -> dict[str, float]:
    return {"oblivious": oblivious, "masked": masked}


def _record(*, rank_times="model", held=0.018, shape_plan=None, real_only=None, dbo=False):
    """A serving_trace record as the family writes it, cut to what the two tables read."""
    layer = _sides(2_100_000.0, 2_000_000.0)
    real_only = real_only or _sides(1_900_000.0, 1_900_000.0)
    head = {"layer_us": layer, "real_only_us": real_only,
            "padding_us": {s: layer[s] - real_only[s] for s in SIDES2},
            "padding_tax": {s: (layer[s] - real_only[s]) / layer[s] for s in SIDES2},
            "recovered_us": 100_000.0, "recovered_share": 0.5, "padded_rows": 10, "padding_row_share": 0.1,
            "real_tokens": 100, "padding_gemm_rows": {"masked": 0, "oblivious": 4},
            "jit_compiles": {"masked": 1, "oblivious": 1},
            "ep_step": {"step_us": _sides(1_302_400.0, 1_100_000.0), "experts_us": _sides(1_200_000.0, 1_000_000.0),
                        "mean_rank_us": _sides(900_000.0, 900_000.0),
                        "straggler_wait_us": _sides(300_000.0, 100_000.0), "wire_us": _sides(102_400.0, 100_000.0),
                        "dispatch_us": _sides(51_200.0, 50_000.0), "combine_us": _sides(51_200.0, 50_000.0),
                        "padding_tax": 0.155, "slowest_rank_padded_route_share": 0.75, "rank_times": rank_times,
                        "tax_split_us": {"gemm_us": 100_000.0, "straggler_us": 200_000.0, "wire_us": 2_400.0,
                                         "overlap_us": -50_000.0 if dbo else 1e-9, "total_us": 302_400.0}}}
    ep = {"rank_times": rank_times, "rank_timings": 6, "distinct_workloads": 10,
          "wire": {"kind": "model", "name": "test"}}
    if rank_times == "model":
        ep["cost_model"] = {"held_out": {"points": 4 if held is not None else 0, "rms_rel": held},
                            "tolerance": 0.03, "within_tolerance": held is not None and held <= 0.03}
    info = {"engine": {"capture_list": "default", "dp_size": 2, "sp_size": 1, "dbo": dbo, "ep_size": 8},
            "trace": {"steps": 1000, "source": "chat"}, "distinct_shapes": 10, "headline": head,
            "shape_plan": shape_plan or {"shape_times": "exact", "distinct_shapes": 10, "shape_timings": 10},
            "ep_step": ep}
    return {"target": "serving_trace", "status": "ok", "params": PARAMS, "info": info}


def _ep_row(rec) -> dict[str, str]:
    head, (row,) = trace_tax.ep_table([rec])
    return dict(zip(head, row))


def _layer_row(rec) -> dict[str, str]:
    head, (row,) = trace_tax.table([rec])
    return dict(zip(head, row))


def test_the_ep_tables_figures_carry_the_rank_models_held_out_error():
    row = _ep_row(_record(held=0.018))
    assert row["step ms oblivious"] == "1302.40 ±1.8%" and row["step ms masked"] == "1100.00 ±1.8%"
    assert row["EP tax"] == "15.5% (model ±1.8%)"  # the error is on the times, not on the share
    assert row["slowest rank: expert ms obl / masked"] == "1200.00 ±1.8% / 1000.00 ±1.8%"
    assert row["straggler wait ms obl / masked"] == "300.00 ±1.8% / 100.00 ±1.8%"
    assert row["wire ms obl / masked"] == "102.40 / 100.00"  # the wire model's, not the rank model's
    split = row["tax split ms: GEMM / straggler / wire / DBO overlap"]
    assert split == "100.00 ±1.8% / 200.00 ±1.8% / 2.40 / DBO off"
    split = _ep_row(_record(held=0.018, dbo=True))["tax split ms: GEMM / straggler / wire / DBO overlap"]
    assert split.endswith(" / 2.40 / -50.00 ±1.8%"), split
    assert row["slowest rank's share of padded routes"] == "75.0%"  # routes counted, no model


def test_an_unchecked_rank_model_says_so_in_every_cell_it_makes_and_timed_ranks_stay_bare():
    row = _ep_row(_record(held=None))
    assert row["step ms oblivious"] == "1302.40 unchecked" and row["EP tax"] == "15.5% (model unchecked)"
    assert row["straggler wait ms obl / masked"] == "300.00 unchecked / 100.00 unchecked"
    timed = _ep_row(_record(rank_times="timed"))
    assert timed["step ms oblivious"] == "1302.40" and timed["EP tax"] == "15.5%"
    assert timed["slowest rank: expert ms obl / masked"] == "1200.00 / 1000.00"


def test_the_word_is_the_one_the_ranking_and_the_plots_give():
    rec = _record(held=0.018)
    word = error_word(trace_tax.typed(rec).ep_step_error()[0])
    assert word == "±1.8%" and _ep_row(rec)["step ms masked"].endswith(" " + word)


def test_the_layer_cells_carry_the_shape_models_word_per_side():
    plan = {"shape_times": "model", "distinct_shapes": 10, "shape_timings": 6,
            "cost_model": {"held_out": {"masked": {"points": 4, "rms_rel": 0.041},
                                        "oblivious": {"points": 4, "rms_rel": 0.012}},
                           "tolerance": 0.03, "within_tolerance": False}}
    row = _layer_row(_record(shape_plan=plan))
    assert row["layer ms oblivious"] == "2100.00 ±1.2%" and row["layer ms masked"] == "2000.00 ±4.1%"
    assert row["padding tax oblivious"] == "9.5% (model ±1.2%)" and row["padding tax masked"] == "5.0% (model ±4.1%)"
    assert row["masks recover"] == "100.00 ms (50.0% of the padding time) (model oblivious ±1.2% / masked ±4.1%)"
    assert row["padded rows"] == "10 (10.0%)"  # rows counted, no model
    plan["cost_model"]["held_out"]["masked"]["rms_rel"] = None  # no held-out round on that side
    row = _layer_row(_record(shape_plan=plan))
    assert row["layer ms masked"] == "2000.00 unchecked" and row["padding tax masked"] == "5.0% (model unchecked)"
    assert row["layer ms oblivious"] == "2100.00 ±1.2%"


def test_interpolated_shapes_without_a_replay_are_unchecked_and_timed_shapes_stay_bare():
    interpolated = _record(shape_plan={"shape_times": "interpolated", "distinct_shapes": 10, "shape_timings": 4})
    row = _layer_row(interpolated)
    assert row["layer ms oblivious"] == "2100.00 unchecked" and row["masks recover"].endswith("(model unchecked)")
    row = _layer_row(_record())
    assert row["layer ms oblivious"] == "2100.00" and row["padding tax masked"] == "5.0%"
    assert row["masks recover"] == "100.00 ms (50.0% of the padding time)"


def test_a_pair_the_run_calls_not_comparable_is_flagged_on_its_layer_cells_as_in_its_headline():
    rec = _record(real_only=_sides(1_500_000.0, 1_900_000.0))  # the masked layer slower on the real rows alone
    assert noise.pair_note([rec], "info.headline.layer_us.oblivious", "info.headline.layer_us.masked")
    row = _layer_row(rec)
    assert row["layer ms oblivious"] == "2100.00 (not comparable)"
    assert row["layer ms masked"] == "2000.00 (not comparable)"
    assert row["padding tax oblivious"] == "not comparable" and row["masks recover"].startswith("not comparable (")
    assert not _layer_row(_record())["layer ms masked"].endswith("(not comparable)")


def _run_dir(base, records):
    run = base / "padding_tax-20260101T000000Z"
    (run / "plots").mkdir(parents=True)
    (run / "plots" / "trace_tax.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # a figure found: none drawn
    manifest = {"created_utc": "2026-01-01T00:00:00+00:00", "device": "cpu",
                "sweep": {"name": "padding_tax", "target": "serving_trace"}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "records.jsonl").write_text("".join(json.dumps({**r, "point": i}) + "\n" for i, r in enumerate(records)))
    return run


def test_the_report_page_shows_each_models_word_in_its_tables(tmp_path):
    run = _run_dir(tmp_path, [_record(held=0.018), _record(held=None)])
    page = write_report([run], tmp_path / "report.html").read_text()
    assert "<td>1302.40 ±1.8%</td>" in page and "<td>1302.40 unchecked</td>" in page
    assert "<td>15.5% (model unchecked)</td>" in page
    md = write_report([run], tmp_path / "report.md").read_text()
    assert "| 1302.40 ±1.8% |" in md and "| 1302.40 unchecked |" in md
