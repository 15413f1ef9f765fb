"""`moebench report`: one self-contained HTML page (or Markdown) of run directories, and its one-line errors."""

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.cli import main
from moebench.plots import make_plots
from moebench.report.page import ReportError, find_plots, load_run, write_report
from moebench.run.runner import run_sweep
from moebench.run.sweep import sweep_from_dict

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
HEADLINE = {"label": "padding routes", "metric": "imbalance.num_padding_routes", "reduce": "sum",
        "without": {"mask": False}, "with": {"mask": True}, "without_label": "unmasked", "with_label": "masked"}


def _fake_run(base, name="demo-20260101T000000Z", records=None, plots_in_run=True):
    run = base / "results" / name
    run.mkdir(parents=True)
    manifest = {"created_utc": "2026-01-01T00:00:00+00:00", "command": "moebench run demo.yaml",
                "git_commit": "abc1234", "device": "cuda",
                "env": {"gpu": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gib": 139.8, "driver": "570.1",
                        "cuda": "12.8", "torch": "2.13.0", "triton": "3.9.0", "deep_ep": None},
                "sweep": {"name": "demo", "target": "router", "axes": {"mask": [False, True]},
                          "description": "masked vs not", "headlines": [HEADLINE]}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    if records is None:
        records = [{"point": i, "impl": "topk_softmax.triton", "status": "ok", "params": {"mask": m},
                    "stats": {"p50": 10.0 + i, "p10": 9.0, "p90": 12.0},
                    "imbalance": {"num_padding_routes": 0 if m else 40, "ep_size": 1,
                                  "expert": {"max_over_mean": 2.5}}} for i, m in enumerate([False, True])]
        records.append({"point": 2, "impl": "topk_softmax.torch", "status": "failed", "params": {"mask": True},
                        "reason": "ValueError: is_padding size mismatch, expected: 8, got: 4"})
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plots = run / "plots" if plots_in_run else base / "plots" / name
    plots.mkdir(parents=True)
    (plots / "latency.png").write_bytes(PNG)
    return run


def test_html_is_self_contained_with_manifest_headlines_table_and_plots(tmp_path):
    run = _fake_run(tmp_path)
    out = write_report([run], tmp_path / "report.html")
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "data:image/png;base64," + base64.b64encode(PNG).decode() in text
    assert "<script" not in text and 'src="http' not in text and "<link" not in text
    for want in ("NVIDIA H200 x1", "abc1234", "2.13.0", "570.1", "moebench run demo.yaml", "padding routes",
                 "unmasked: 40", "masked: 0", "topk_softmax.triton", "is_padding size mismatch", "failed 1, ok 2"):
        assert want in text, want


def test_markdown_links_plots_relative_to_the_output(tmp_path):
    run = _fake_run(tmp_path)
    (tmp_path / "docs").mkdir()
    out = write_report([run], tmp_path / "docs" / "report.md")
    text = out.read_text()
    assert "![latency](../results/demo-20260101T000000Z/plots/latency.png)" in text
    assert "| padding routes | unmasked: 40 | masked: 0 | to 0 |  |" in text
    assert "- **commit**: `abc1234`" in text and "data:image" not in text


def test_plots_found_in_the_run_first_then_beside_results(tmp_path):
    run = _fake_run(tmp_path, plots_in_run=False)
    assert find_plots(run) == [tmp_path / "plots" / run.name / "latency.png"]
    (run / "plots").mkdir()
    (run / "plots" / "own.png").write_bytes(PNG)
    assert [p.name for p in find_plots(run)] == ["own.png"]


def test_several_runs_on_one_page(tmp_path):
    a = _fake_run(tmp_path, "a-20260101T000000Z")
    b = _fake_run(tmp_path, "b-20260101T000000Z")
    text = write_report([a, b], tmp_path / "r.html", title="two runs").read_text()
    assert "<title>two runs</title>" in text and 'href="#run-1"' in text and text.count("<h2 ") == 2


@pytest.mark.parametrize("case, why", [
    ("missing", "not a run directory (no such directory)"),
    ("no_records", "not a run directory (no records.jsonl)"),
    ("empty", "empty run (no records in records.jsonl)"),
    ("suffix", "the output must end in .html or .md"),
    ("no_dir", "no such directory"),
])
def test_bad_input_is_exit_2_one_line_and_nothing_written(tmp_path, capsys, case, why):
    run = _fake_run(tmp_path)
    out = tmp_path / "out.html"
    if case == "missing":
        args = [str(tmp_path / "nope")]
    elif case == "no_records":
        (run / "records.jsonl").unlink()
        args = [str(run)]
    elif case == "empty":
        (run / "records.jsonl").write_text("\n")
        args = [str(run)]
    elif case == "suffix":
        args, out = [str(run)], tmp_path / "out.pdf"
    else:
        args, out = [str(run)], tmp_path / "nodir" / "out.html"
    with pytest.raises(ReportError) as e:
        write_report(args, out)
    assert why in str(e.value) and "\n" not in str(e.value)
    capsys.readouterr()
    code = main(["report", *args, "-o", str(out)])  # the CLI in this process (`python -m moebench` is main())
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and why in err
    assert not out.exists()
    if out.parent.exists():
        assert not list(out.parent.glob(".*.tmp"))


def test_a_real_run_reports_its_declared_headlines(tmp_path):
    sweep = sweep_from_dict({"name": "rep", "target": "router", "impls": ["topk_softmax.torch"],
                             "fixed": {"num_experts": 16, "top_k": 2, "num_tokens": 16, "padding_ratio": 0.5},
                             "axes": {"mask": [False, True]}, "timing": {"warmup": 0, "iters": 2},
                             "headlines": [HEADLINE]})
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device="cpu", out=open("/dev/null", "w"))
    assert code == 0
    make_plots(run_dir, tmp_path / "plots" / run_dir.name)  # where `moebench run --plots` puts them
    view = load_run(run_dir)
    (row,) = view.headlines
    assert row.without == 16 and row.with_ == 0  # 8 padded rows x top-2, unmasked
    text = write_report([run_dir], tmp_path / "r.html").read_text()
    assert "unmasked: 16" in text
    assert view.plots and all(p.suffix == ".png" for p in view.plots)
    assert text.count("data:image/png;base64,") == len(view.plots)


PROFILE_POINT = "moebench/layer/layer.masked"


def _profile_json(folder, error=None):
    """A profile.json as `moebench profile` writes it: the point's range and two of its stages."""
    def row(name, parent, dev, share, kernels):
        return {"range": name, "count": 20, "cpu_total_us": 400.0, "cpu_mean_us": 20.0, "device_total_us": dev,
                "device_mean_us": dev / 20, "device_source": "nvtx_kern_sum", "kernel_kind": "gpu_kernel",
                "kernels": [{"name": k, "count": 20, "total_us": t, "mean_us": t / 20} for k, t in kernels],
                "device_span_us": None, "parent": parent, "device_share": share}
    summary = [row(PROFILE_POINT, "", 1000.0, 1.0, [("_gate_up_kernel", 700.0), ("_down_kernel", 200.0),
                                                  ("_topk_kernel", 60.0), ("_sum_kernel", 40.0)]),
               row(PROFILE_POINT + "/route", PROFILE_POINT, 60.0, 0.06, [("_topk_kernel", 60.0)]),
               row(PROFILE_POINT + "/experts", PROFILE_POINT, 900.0, 0.9, [("_gate_up_kernel", 700.0),
                                                                          ("_down_kernel", 200.0)])]
    folder.mkdir(parents=True)
    (folder / "profile.json").write_text(json.dumps({
        "mode": "nsys", "point": 0, "impl": "layer.masked", "summary": summary, "error": error,
        "launch": "eager launches", "iterations": 20,
        "header": "device time from eager launches, 20 profiled iterations (nsys nvtx_kern_sum)"}))
    return folder


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_profile_breakdown_of_a_run_and_of_a_profile_folder(tmp_path, suffix):
    run = _fake_run(tmp_path)
    _profile_json(run / "profile-layer-p0-20260101T000000Z")
    alone = _profile_json(tmp_path / "runs" / "profile-layer-p0-20260102T000000Z", error="nsys stats rc=1")
    out = write_report([run, alone], tmp_path / f"r{suffix}")
    text = out.read_text()
    assert text.count("Profile: where the device time goes") == 2
    assert "device time from eager launches, 20 profiled iterations" in text and "nsys stats rc=1" in text
    for cell in (PROFILE_POINT + "/experts", "90.0%", "45.0", "_gate_up_kernel x20 700.0 us", "6.0%"):
        assert cell in text, cell
    assert "_sum_kernel" not in text  # top 3 kernels per range only
    assert "Points" in text  # the run keeps its table; the profile-only folder has none
    assert load_run(alone).records == [] and len(load_run(run).profiles) == 1


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_profile_folder_alone_shows_no_empty_manifest(tmp_path, suffix):
    """A profile's own folder has no manifest or records: the page shows its breakdown, not '?' fields, 'GPU:
    none' and 'No plots found'."""
    alone = _profile_json(tmp_path / "runs" / "profile-layer-p0-20260102T000000Z")
    text = write_report([alone], tmp_path / f"r{suffix}").read_text()
    assert "Profile: where the device time goes" in text
    for absent in ("No plots found", "commit", "points:", "**status**"):
        assert absent not in text, absent


# ---------------------------------------------------------------------------------------------------------------
# A page that stands alone: timing mode, stdout's caveats, one number format, stdout's names, figures from records
# ---------------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "results/h200/scenarios/dbo_mask_slices-20261201T104017Z"  # 3 records: a quick draw


def _cpu_records():
    """A CPU run's records as the runner writes them: Triton in the interpreter, host wall clock."""
    def rec(i, impl, p50, **more):
        return {"point": i, "impl": impl, "status": "ok", "params": {"num_tokens": 64 * (i + 1)}, "device": "cpu",
                "triton_interpret": True, "timing_mode": "wall", "stats": {"p50": p50, "p10": p50, "p90": p50,
                                                                           "cv": 0.05},
                "imbalance": {"ep_size": 1, "expert": {"max_over_mean": 2.5}}, **more}
    return [rec(0, "topk_softmax.triton", 376175.423), rec(1, "topk_softmax.triton", 44213.24),
            {"point": 2, "impl": "topk_softmax.vllm", "status": "skipped", "params": {"num_tokens": 64},
             "reason": "vllm is not installed (no module 'vllm')"}]


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_a_cpu_run_states_its_timing_mode_caveats_names_and_numbers_as_stdout_does(tmp_path, suffix):
    import io

    from moebench.report.table import Table

    records = _cpu_records()
    run = _fake_run(tmp_path, records=records)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(device="cpu", env={"cpu": "AMD EPYC", "cpu_count": 2, "triton_interpret": "1"})
    (run / "manifest.json").write_text(json.dumps(manifest))
    text = write_report([run], tmp_path / f"r{suffix}").read_text()
    assert "Triton interpreter on CPU: timings are not GPU figures" in text
    stdout = io.StringIO()
    Table(["num_tokens"], out=stdout).footer(records)
    caveats = [line[2:] for line in stdout.getvalue().splitlines() if line[2:].strip()]
    rows = io.StringIO()
    table = Table(["num_tokens"], out=rows)
    table.header()
    for r in records:
        table.row(r)
    assert "376175.42" in rows.getvalue() and "44213.24" in rows.getvalue() and "e+0" not in rows.getvalue()
    assert "skipped 1: vllm is not installed (no module 'vllm')" in caveats
    for line in caveats:
        assert line.replace("'", "&#x27;" if suffix == ".html" else "'") in text, line
    assert "376175.42" in text and "44213.24" in text and "e+0" not in text  # one fixed format, no 3.762e+05
    assert "maxvio" in text and "max/mean" not in text and "p50 (us)" in text


def test_the_timing_mode_of_gpu_and_host_clock_runs(tmp_path):
    from moebench.report.table import timing_statement

    gpu = {"env": {"gpu": "NVIDIA H200"}, "device": "cuda"}
    graph = [{"status": "ok", "timing_mode": "cuda_graph", "device": "cuda"}]
    assert timing_statement(graph, gpu) == ("timing: CUDA-graph replay on NVIDIA H200", True)
    wall = [{"status": "ok", "timing_mode": "wall", "device": "cpu"}]
    assert timing_statement(wall, {"device": "cpu"}) == ("timing: host wall clock on the CPU: timings are not "
                                                         "GPU figures", False)
    text, gpu_figures = timing_statement(graph + [dict(graph[0], timing_mode="events")], gpu)
    assert gpu_figures and text == ("timing: CUDA-graph replay on NVIDIA H200 (1 point); CUDA events on "
                                    "NVIDIA H200 (1 point)")


def _committed_copy(tmp_path):
    """The committed run's records and manifest (no figures), in a folder of their own."""
    run = tmp_path / COMMITTED.name
    run.mkdir()
    for name in ("manifest.json", "records.jsonl"):
        (run / name).write_bytes((COMMITTED / name).read_bytes())
    return run


def test_a_committed_run_gets_its_figures_drawn_from_the_records(tmp_path):
    run = _committed_copy(tmp_path)
    assert find_plots(run) == []
    text = write_report([run], tmp_path / "r.html").read_text()
    drawn = sorted((run / "plots").glob("*.png"))
    assert drawn and text.count("data:image/png;base64,") == len(drawn)
    assert f"Drawn from the stored records into {run / 'plots'}" in text and "No plots found" not in text
    assert "timing: CUDA-graph replay on NVIDIA H200" in text
    # the headline first: the timing mode, then the headline numbers, then the figures, the table last
    order = [text.index(s) for s in ("timing: CUDA-graph", "Headline numbers", "data:image/png", "<h3>Points")]
    assert order == sorted(order)


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_a_read_only_run_gets_its_figures_drawn_for_the_page_only(tmp_path, monkeypatch, suffix):
    from moebench.report import figures

    run = _committed_copy(tmp_path)
    monkeypatch.setattr(figures, "writable_plot_dir", lambda run_dir: None)  # as a run directory we may not write
    (tmp_path / "out").mkdir()
    text = write_report([run], tmp_path / "out" / f"page{suffix}").read_text()
    assert not (run / "plots").exists()
    assert "for this page only (the run directory is read-only)" in text
    if suffix == ".html":
        assert text.count("data:image/png;base64,") >= 1 and list((tmp_path / "out").iterdir()) == [
            tmp_path / "out" / "page.html"]
    else:
        pngs = sorted((tmp_path / "out" / "page-plots" / run.name).glob("*.png"))
        assert pngs and all(f"](page-plots/{run.name}/{p.name})" in text for p in pngs)


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="no chromium to screenshot with")
def test_report_screenshot_writes_a_png_of_the_page(tmp_path):
    run = _fake_run(tmp_path)
    out = tmp_path / "page.png"
    proc = subprocess.run([sys.executable, str(REPO / "scripts/report_screenshot.py"), str(run), "-o", str(out),
                           "--width", "800", "--height", "600"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_headline_numbers_are_never_in_scientific_notation():
    from moebench.report.headline import format_value

    assert [format_value(v) for v in (97920.5, 0.1956, 2.5, 1.0, 3e-6)] == ["97920", "0.1956", "2.5", "1", "0.000003"]
