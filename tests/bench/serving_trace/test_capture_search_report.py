"""What the operator reads of a capture-search record, from a record made here (no point run): the per-K table's
columns sized to their cells (a saving `within noise` is wider than a plain one), the eager steps' source in the
footnote, and the figure drawn as one of the run's figures by `moebench plot` and `moebench report`."""

import json
import re

from moebench.cli import main
from moebench.plots import KINDS, make_plots
from moebench.report.capture_search import table_lines

SIDES = ("masked", "oblivious")


def _side(noise: float | None, base: float) -> dict:
    per_k = {str(k): {"sizes": sizes, "graphs": len(sizes), "searched_us": t,
                      "figures": {s: {"time_us": t, "padding_tax": 0.2, "eager_launch_us": 3.5} for s in SIDES}}
             for k, sizes, t in ((1, [7], base * 1.3), (2, [3, 7], base * 1.01), (4, [2, 3, 5, 7], base))}
    return {"per_k": per_k, "curve_us": [base * 1.3, base * 1.01, base, base], "lower_bound_us": base,
            "within_1pct_k": 2, "candidates": 4, "method": "full minimum", "noise_rel": noise}


def search_info(eager: dict | None = None) -> dict:
    """A capture-search record's info: against `default` the K=4 list saves 2% within the noise, the K=1 one costs
    more than it, outside the noise."""
    named = {name: {"graphs": g, **{s: {"time_us": t} for s in SIDES}}
             for name, g, t in (("default", 35, 1020.0), ("fine", 51, 1000.0))}
    return {"trace": {"steps": 6, "distinct_steps": 4}, "budgets": [1, 2, 4], "largest": None, "keep": [],
            "capture_search": {
                "card": "cpu (interpreter)", "named": named,
                "sides": {"masked": _side(0.05, 1000.0), "oblivious": _side(None, 1000.0)},
                "eager": eager or {"source": "documented figure", "note": "docs/hardware.md: the empty kernel",
                                   "per_call_us": {"masked": 26.82, "oblivious": 23.84},
                                   "launches_per_call": {"masked": 9, "oblivious": 8},
                                   "launches_counted": "interpreted Triton launches"}}}


def _right_aligned(header: str, rows: list[str], title: str) -> bool:
    """Every row's cells under each `title` of the header end where the title ends."""
    ends = [m.end() for m in re.finditer(re.escape(title), header)]
    return bool(ends) and all(r[end - 1] != " " and (len(r) == end or r[end] == " ") for r in rows for end in ends)


def test_the_per_k_columns_are_as_wide_as_their_cells():
    lines = table_lines(search_info())
    header = next(line for line in lines if line.lstrip().startswith("K "))
    rows = [line for line in lines if re.match(r"\s+\d+\s+(masked|oblivious)\s", line)]
    assert len(rows) == 6 and any("(within noise)" in r for r in rows) and any("more" in r for r in rows)
    for title in ("graphs", "time (ms)", "eager (ms)", "vs default", "vs fine"):
        assert _right_aligned(header, rows, title), (title, [header] + rows)
    assert {r.index("[") for r in rows} == {header.index("list")}
    start = next(i for i, line in enumerate(lines) if line.startswith("named lists:"))
    named_header, named = lines[start], lines[start + 1:start + 3]
    assert any("(within noise)" in r for r in named)
    for title in ("graphs", "masked (ms)", "oblivious (ms)", "best <= graphs"):
        assert _right_aligned(named_header, named, title), (title, [named_header] + named)


def test_the_footnote_says_where_the_eager_price_comes_from():
    (line,) = [line for line in table_lines(search_info()) if line.startswith("eager steps:")]
    assert "documented figure (docs/hardware.md" in line and "masked 26.82 | oblivious 23.84 us" in line
    measured = {"source": "measured", "per_call_us": {"masked": 12.5, "oblivious": 11.0},
                "launches_per_call": {"masked": 30, "oblivious": 28}, "launches_counted": "CUDA kernels",
                "measured": {"shapes": [[256, 256], [512, 512]],
                             "eager_us": {"masked": [80.0, 120.0], "oblivious": [70.0, 100.0]},
                             "graph_us": {"masked": [65.0, 110.0], "oblivious": [57.0, 91.0]},
                             "over_graph_us": {"masked": [15.0, 10.0], "oblivious": [13.0, 9.0]}}}
    (line,) = [line for line in table_lines(search_info(measured)) if line.startswith("eager steps:")]
    assert "measured on this layer at (256 rows, 256 real), (512 rows, 512 real)" in line
    assert "masked eager 80.0/120.0 us vs graph 65.0/110.0 us" in line and "documented" not in line


def _run_dir(tmp_path):
    run = tmp_path / "capture_search-run"
    run.mkdir(parents=True)
    record = {"point": 0, "key": "k0", "impl": "serving_trace.capture_search", "kernel": "serving_trace",
              "status": "ok", "params": {"model": "deepseek-v3"}, "info": search_info()}
    (run / "records.jsonl").write_text(json.dumps(record) + "\n")
    (run / "manifest.json").write_text(json.dumps({"sweep": {"name": "capture_search"}}))
    return run


def test_plot_and_report_draw_the_capture_search_figure(tmp_path, capsys):
    assert "capture_search" in KINDS
    run = _run_dir(tmp_path)
    assert [p.name for p in make_plots(run, run / "plots")] == ["capture_search.png"]
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plots" / "capture_search.png")
    drawn = json.loads((run / "plots" / "plots.json").read_text())["plots"]
    assert [p["kind"] for p in drawn] == ["capture_search"]
    fresh = _run_dir(tmp_path / "again")  # no plots yet: the page draws them from the records
    assert main(["report", str(fresh), "-o", str(tmp_path / "x.html")]) == 0
    assert 'alt="capture_search.png"' in (tmp_path / "x.html").read_text()
