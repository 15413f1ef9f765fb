"""`moebench profile` per stage: the profiled eager iterations and their nested NVTX ranges, device time per range
from nsys CSVs (nvtx_kern_sum, or the trace join) and from torch.profiler traces, the stage breakdown, the CSV and
table, the libraries nsys needs, and the layer's profile end to end (CPU here, the H200 in the gpu test)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moebench.measure import nvtx
from moebench.measure.nvtx import EAGER_LAUNCHES, profiled_iterations, stage_range_name
from moebench.profile import (CSV_COLUMNS, add_breakdown, driver, format_summary, join_traces, summarize_nsys_csv,
                              summarize_nsys_traces, summarize_trace, write_summary_csv)

POINT = "moebench/layer/layer.masked"
STAGES = ("route", "stage", "expert_map", "align", "experts", "reduce")
REPO = Path(__file__).resolve().parents[2]


def test_profiled_iterations_nest_stage_ranges_and_bracket_the_hook(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(nvtx, "_backend", lambda: ("fake", lambda n: calls.append("push " + n),
                                                   lambda: calls.append("pop")))
    pipeline = [(s, (lambda s=s: calls.append("run " + s))) for s in ("route", "experts")]
    res = profiled_iterations(lambda: calls.append("run()"), pipeline, POINT, 2, "cpu", calls.append)
    one = ["push " + POINT, f"push {POINT}/route", "run route", "pop", f"push {POINT}/experts", "run experts", "pop",
           "pop"]
    assert calls == ["start", *one, *one, "stop"]  # run() itself is not called when the phases are
    assert res == {"iterations": 2, "launch": EAGER_LAUNCHES, "point_range": POINT,
                   "stage_ranges": [f"{POINT}/route", f"{POINT}/experts"]}
    calls.clear()
    profiled_iterations(lambda: calls.append("run()"), [], POINT, 1, None, None)
    assert calls == ["push " + POINT, "run()", "pop"]
    assert stage_range_name(POINT, "align") == POINT + "/align"
    with pytest.raises(ValueError):
        stage_range_name(POINT, "")


def test_layer_and_dispatch_cases_declare_their_pipelines():
    """The layer's pipeline is its six stages (run() calls exactly them); a dispatch point's is
    dispatch -> experts -> combine and, called in order, writes what run() writes."""
    from moebench import registry
    from moebench.params import Params

    registry.load_all()
    p = Params(num_tokens=16, hidden=128, num_experts=8, top_k=2, ep_size=1, padding_ratio=0.25)
    case = registry.get("dispatch.agrs").build(p, registry.RunContext(device=torch.device("cpu")))
    assert [n for n, _ in case.pipeline] == ["dispatch", "experts", "combine"]
    want = case.run().clone()
    for _, fn in case.pipeline:
        got = fn()
    assert torch.equal(got, want)
    from moebench.bench.layer import STAGES

    p = Params(num_tokens=8, hidden=128, intermediate=64, num_experts=16, top_k=2, padding_ratio=0.25)
    case = registry.get("layer.masked").build(p, registry.RunContext(device=torch.device("cpu")))
    assert [n for n, _ in case.pipeline] == list(STAGES) == [n for n, _ in case.stages]


# ---------------------------------------------------------------------------------------------------------------
# nsys CSVs
# ---------------------------------------------------------------------------------------------------------------

NVTX_SUM = f"""Generating NVTX Range Summary...
Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
50.0,"1,000,000",20,50000.0,50000.0,40000,60000,10.0,PushPop,:{POINT}
20.0,200000,20,10000.0,10000.0,9000,11000,1.0,PushPop,:{POINT}/route
30.0,600000,20,30000.0,30000.0,29000,31000,1.0,PushPop,:{POINT}/experts
1.0,100,1,100.0,100.0,100,100,0.0,PushPop,:unrelated
"""
# nvtx_kern_sum counts a kernel for every range on the stack at its launch; one row per PID/TID
NVTX_KERN_SUM = f"""NVTX Range,Style,PID,TID,NVTX Inst,Kern Inst,Total Time (ns),Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Kernel Name
:{POINT},PushPop,1,1,20,20,40000,2000.0,2000.0,1,1,0.0,_topk_kernel
:{POINT},PushPop,1,1,20,20,500000,25000.0,25000.0,1,1,0.0,_gate_up_kernel
:{POINT},PushPop,1,1,20,20,300000,15000.0,15000.0,1,1,0.0,_down_kernel
:{POINT},PushPop,1,2,20,20,60000,3000.0,3000.0,1,1,0.0,_gate_up_kernel
:{POINT}/route,PushPop,1,1,20,20,40000,2000.0,2000.0,1,1,0.0,_topk_kernel
:{POINT}/experts,PushPop,1,1,20,20,500000,25000.0,25000.0,1,1,0.0,_gate_up_kernel
:{POINT}/experts,PushPop,1,2,20,20,60000,3000.0,3000.0,1,1,0.0,_gate_up_kernel
:{POINT}/experts,PushPop,1,1,20,20,300000,15000.0,15000.0,1,1,0.0,_down_kernel
,,1,1,0,5,999,1.0,1.0,1,1,0.0,unscoped_kernel
"""
NVTX_GPU_PROJ_SUM = f"""Range,Style,Total Proj Time (ns),Total Range Time (ns),Range Instances,Proj Avg (ns),Proj Med (ns),Proj Min (ns),Proj Max (ns),Proj StdDev (ns),Total GPU Ops,Avg GPU Ops,Avg Range Lvl,Avg Num Child
:{POINT},PushPop,950000,1000000,20,47500.0,1,1,1,0.0,60,3.0,0.0,2.0
:{POINT}/experts,PushPop,880000,600000,20,44000.0,1,1,1,0.0,40,2.0,1.0,0.0
"""


def _write(tmp_path: Path, **files: str) -> dict[str, Path]:
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"profile_{name}.csv"
        out[name].write_text(text)
    return out


def test_nsys_kern_sum_gives_device_time_per_stage_and_shares(tmp_path):
    f = _write(tmp_path, nvtx_sum=NVTX_SUM, nvtx_kern_sum=NVTX_KERN_SUM, nvtx_gpu_proj_sum=NVTX_GPU_PROJ_SUM)
    rows = add_breakdown(summarize_nsys_csv(f["nvtx_sum"], f["nvtx_kern_sum"], f["nvtx_gpu_proj_sum"]))
    by = {r["range"]: r for r in rows}
    assert [r["range"] for r in rows] == [POINT, POINT + "/route", POINT + "/experts"]  # unrelated left out
    point, route, experts = by[POINT], by[POINT + "/route"], by[POINT + "/experts"]
    assert point["count"] == 20 and point["cpu_total_us"] == 1000.0 and point["cpu_mean_us"] == 50.0
    assert point["device_total_us"] == pytest.approx(900.0) and point["device_mean_us"] == pytest.approx(45.0)
    # the two TID rows of one kernel are one kernel; kernels by time
    assert [(k["name"], k["count"], k["total_us"]) for k in experts["kernels"]] == \
        [("_gate_up_kernel", 40, 560.0), ("_down_kernel", 20, 300.0)]
    assert experts["device_total_us"] == pytest.approx(860.0) and experts["device_source"] == "nvtx_kern_sum"
    assert experts["device_span_us"] == 880.0 and route["device_span_us"] is None
    assert route["parent"] == POINT and point["parent"] == ""
    assert point["device_share"] == 1.0
    assert experts["device_share"] == pytest.approx(860 / 900) and route["device_share"] == pytest.approx(40 / 900)
    # without nvtx_kern_sum: host figures only, device unknown (not zero)
    (p2, *_) = summarize_nsys_csv(f["nvtx_sum"], tmp_path / "absent.csv")
    assert p2["device_total_us"] is None and p2["device_source"] == ""


# The fallback's inputs: one iteration with two stages; the route launch on another thread must not count.
PUSHPOP = f"""Start (ns),End (ns),Duration (ns),DurChild (ns),DurNonChild (ns),Name,PID,TID,Lvl,NumChild,RangeId,ParentId,RangeStack,NameTree
1000,9000,8000,6000,2000,:{POINT},7,7,0,2,1,,:1,:{POINT}
1500,3000,1500,0,1500,:{POINT}/route,7,7,1,0,2,1,:1:2,--:{POINT}/route
3500,8500,5000,0,5000,:{POINT}/experts,7,7,1,0,3,1,:1:3,--:{POINT}/experts
20000,21000,1000,0,1000,:other,7,7,0,0,4,,:4,:other
"""
API = """Start (ns),Duration (ns),Name,Result,CorrID,Pid,Tid,T-Pri,Thread Name
1600,100,cuLaunchKernel,0,11,7,7,0,python
1700,100,cuLaunchKernel,0,12,7,8,0,other
3600,100,cuLaunchKernel,0,13,7,7,0,python
4000,100,cudaMemsetAsync,0,14,7,7,0,python
20100,100,cuLaunchKernel,0,15,7,7,0,python
"""
GPU = """Start (ns),Duration (ns),CorrId,GrdX,GrdY,GrdZ,BlkX,BlkY,BlkZ,Device,Ctx,Strm,Name
1900,2000,11,1,1,1,128,1,1,0,1,7,_topk_kernel
2000,3000,12,1,1,1,128,1,1,0,1,7,_other_thread_kernel
9100,5000,13,1,1,1,128,1,1,0,1,7,_gate_up_kernel
14200,1000,14,1,1,1,128,1,1,0,1,7,[CUDA memset]
20200,9000,15,1,1,1,128,1,1,0,1,7,_unrelated
"""


def test_trace_join_fallback_attributes_by_launch_and_thread(tmp_path):
    f = _write(tmp_path, nvtx_pushpop_trace=PUSHPOP, cuda_api_trace=API, cuda_gpu_trace=GPU,
               nvtx_gpu_proj_sum=NVTX_GPU_PROJ_SUM)
    rows = add_breakdown(summarize_nsys_traces(f["nvtx_pushpop_trace"], f["cuda_api_trace"], f["cuda_gpu_trace"],
                                               f["nvtx_gpu_proj_sum"]))
    by = {r["range"]: r for r in rows}
    assert list(by) == [POINT, POINT + "/route", POINT + "/experts"]
    # the experts kernel runs after its range closed (9100 > 8500): attributed by its launch, not its GPU time
    assert [(k["name"], k["total_us"]) for k in by[POINT + "/experts"]["kernels"]] == \
        [("_gate_up_kernel", 5.0), ("[CUDA memset]", 1.0)]
    assert by[POINT + "/route"]["device_total_us"] == 2.0  # the other thread's launch is not the route's
    assert by[POINT]["device_total_us"] == 8.0 and by[POINT]["cpu_total_us"] == 8.0
    assert by[POINT + "/experts"]["device_share"] == pytest.approx(6 / 8)
    assert by[POINT + "/experts"]["device_source"] == "trace join" and by[POINT]["device_span_us"] == 950.0
    # no thread columns at all: ranges and calls are matched by time alone
    strip = [{k: v for k, v in r.items() if k.lower() != "tid"} for r in csv.DictReader(API.splitlines())]
    rows2 = {r["range"]: r for r in join_traces(list(csv.DictReader(PUSHPOP.splitlines())), strip,
                                                list(csv.DictReader(GPU.splitlines())))}
    assert rows2[POINT + "/route"]["device_total_us"] == 5.0


def _gpu_trace_nested() -> dict:
    """A torch.profiler-shaped trace: one point range holding two stage ranges, a launch in each."""
    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
                **({"args": args} if args else {})}
    ev = [x("user_annotation", POINT, 0, 100), x("user_annotation", POINT + "/route", 5, 20),
          x("user_annotation", POINT + "/experts", 30, 60),
          x("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
          x("cuda_runtime", "cudaLaunchKernel", 40, 2, correlation=2),
          x("cuda_runtime", "cudaLaunchKernel", 50, 2, correlation=3),
          x("kernel", "_topk_kernel", 20, 4, correlation=1), x("kernel", "_gate_up_kernel", 60, 30, correlation=2),
          x("kernel", "_down_kernel", 95, 6, correlation=3)]
    return {"traceEvents": ev}


def test_torch_trace_nested_stage_breakdown_csv_and_table(tmp_path):
    rows = add_breakdown(summarize_trace(_gpu_trace_nested()))
    by = {r["range"]: r for r in rows}
    assert by[POINT]["device_total_us"] == 40 and by[POINT + "/experts"]["device_total_us"] == 36
    assert by[POINT + "/route"]["device_share"] == pytest.approx(0.1)
    path = write_summary_csv(rows, tmp_path / "s.csv", launch=EAGER_LAUNCHES)
    table = list(csv.DictReader(path.read_text().splitlines()))
    assert tuple(table[0]) == CSV_COLUMNS and CSV_COLUMNS[:12] == (
        "range", "count", "cpu_total_us", "cpu_mean_us", "device_total_us", "device_mean_us", "device_source",
        "kernel_kind", "kernel", "kernel_count", "kernel_total_us", "kernel_mean_us")  # the columns it always had
    experts = [r for r in table if r["range"] == POINT + "/experts"]
    assert [r["kernel"] for r in experts] == ["_gate_up_kernel", "_down_kernel"]
    assert experts[0]["parent"] == POINT and float(experts[0]["device_share"]) == pytest.approx(0.9)
    assert {r["launch"] for r in table} == {EAGER_LAUNCHES}
    text = format_summary(rows, header="device time from eager launches")
    lines = text.splitlines()
    assert lines[0] == "# device time from eager launches"
    line = next(ln for ln in lines if ln.strip().startswith(POINT + "/experts"))
    assert line.startswith("  ") and line.rstrip().endswith("90.0%")
    assert "_gate_up_kernel" in text and "_down_kernel" in text
    many = [dict(rows[0], kernels=[{"name": f"k{i}", "count": 1, "total_us": 10.0 - i, "mean_us": 1.0}
                                   for i in range(5)])]
    assert "k2" in format_summary(many) and "k3" not in format_summary(many) and "2 more kernels" in \
        format_summary(many)


# ---------------------------------------------------------------------------------------------------------------
# Libraries for nsys
# ---------------------------------------------------------------------------------------------------------------

def test_nsys_libs_from_an_unpacked_folder_and_the_env(tmp_path, monkeypatch):
    lib = tmp_path / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libdw.so.1").write_bytes(b"")
    assert driver.nsys_lib_dirs(str(tmp_path / "root")) == [str(lib)]
    monkeypatch.setenv(driver.LIBS_ENV, str(tmp_path / "root"))
    monkeypatch.delenv("MOEBENCH_NSYS_LIBDIR", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/keep")
    assert driver._stats_env()["LD_LIBRARY_PATH"] == f"{lib}:/keep"
    with pytest.raises(RuntimeError, match="no such folder"):
        driver.nsys_lib_dirs(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="no .deb files"):
        driver.nsys_lib_dirs(str(tmp_path / "empty"))
    monkeypatch.delenv(driver.LIBS_ENV)
    assert driver.nsys_lib_dirs() == [] and driver._stats_env()["LD_LIBRARY_PATH"] == "/keep"
    assert driver.LIBS_ENV in driver._with_libdw_hint("nsys profile rc=1: libdw.so.1: cannot open")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to build a .deb")
def test_nsys_libs_from_deb_files_unpacked_once(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text("Package: libfake1\nVersion: 1.0\nArchitecture: amd64\n"
                                            "Maintainer: t <t@t>\nDescription: test\n")
    lib = pkg / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libfake.so.1").write_bytes(b"\x7fELF")
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(debs / "libfake1.deb")], check=True, capture_output=True)
    driver._unpack_debs.cache_clear()
    (first,) = driver.nsys_lib_dirs(str(debs))
    assert first.endswith("usr/lib/x86_64-linux-gnu") and (Path(first) / "libfake.so.1").exists()
    assert driver.nsys_lib_dirs(str(debs)) == [first]  # unpacked once per process


FAKE_NSYS = """#!{python}
import sys
args = sys.argv[1:]
if args[0] == "profile":
    sys.stderr.write("ImportNvtxt: error while loading shared libraries: libdw.so.1: cannot open shared object\\n")
    sys.exit(1)
"""


def test_missing_libdw_error_says_what_to_set(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text(FAKE_NSYS.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.delenv(driver.LIBS_ENV, raising=False)
    res = driver._profile_nsys(str(fake), "sweeps/x.yaml", 0, tmp_path, None, "cuda", 2, timeout_s=60)
    assert "libdw.so.1" in res["error"] and f"set {driver.LIBS_ENV}" in res["error"]


# ---------------------------------------------------------------------------------------------------------------
# The layer's profile end to end
# ---------------------------------------------------------------------------------------------------------------

TINY_LAYER = ["--set", "num_tokens=8", "--set", "hidden=128", "--set", "intermediate=64", "--set", "num_experts=16",
              "--set", "num_local_experts=16"]


def _profile_cli(out: Path, *extra: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "moebench", "profile", "sweeps/layer.yaml", "--point", "0", "--iters", "2",
           "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    dirs = sorted(out.glob("profile-layer-p0-*"))
    result = json.loads((dirs[-1] / "profile.json").read_text()) if dirs else {}
    return proc, result


def test_layer_profile_on_cpu_gives_every_stage_its_wall_time_share_and_kernels(tmp_path, capsys):
    """A CPU profile of a layer point: every stage range with its wall time (> 0) and share of the point's, the
    interpreted Triton kernels of each stage (not the interpreter's own torch calls), and the statement that
    these are interpreter times, not GPU figures."""
    # In this process (the CLI's exit code and output are what is checked; a fresh interpreter adds only its
    # start-up), and one timed sample per stage before the profiled iterations: the ranges do not depend on it.
    from moebench.cli import main

    code = main(["profile", str(REPO / "sweeps" / "layer.yaml"), "--point", "0", "--iters", "2", "--out",
                 str(tmp_path), "--device", "cpu", *TINY_LAYER, "--set", "timing.warmup=0", "--set", "timing.iters=1"])
    out, err = capsys.readouterr()
    (run_dir,) = tmp_path.glob("profile-layer-p0-*")
    res = json.loads((run_dir / "profile.json").read_text())
    assert code == 0, out[-2000:] + err[-2000:]
    assert res["mode"] == "torch.profiler" and res["launch"] == EAGER_LAUNCHES and res["triton_interpret"]
    assert res["profiled"]["stage_ranges"] == [f"{POINT}/{s}" for s in STAGES]
    by = {s["range"]: s for s in res["summary"]}
    assert list(by) == [POINT, *(f"{POINT}/{s}" for s in STAGES)]
    for name, s in by.items():
        assert s["count"] == 2 and s["cpu_total_us"] > 0 and s["wall_share"] > 0, s
        assert s["device_total_us"] is None and s["parent"] == ("" if name == POINT else POINT)
    for stage in STAGES:  # each stage's work is its Triton kernels, run in the interpreter
        top = by[f"{POINT}/{stage}"]["kernels"][0]
        assert top["name"].startswith("triton/_") and top["count"] >= 2, (stage, by[f"{POINT}/{stage}"]["kernels"])
    assert not any(k["name"] == "aten::set_" for s in by.values() for k in s["kernels"])
    assert 0.9 < sum(by[f"{POINT}/{s}"]["wall_share"] for s in STAGES) <= 1.0
    assert by[POINT]["wall_share"] == 1.0
    # the printed table: wall columns, every stage with a non-zero share, and what the times are
    assert "Triton's interpreter ran the kernels" in out and "not GPU figures" in out and "dev total" not in out
    for stage in STAGES:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{POINT}/{stage} "))
        assert line.rstrip().endswith("%") and not line.rstrip().endswith(" 0.0%"), line
    rows = list(csv.DictReader((run_dir / "profile_summary.csv").read_text().splitlines()))
    assert all(float(r["wall_share"]) > 0 for r in rows)


def _nsys_ready() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if driver.find_nsys() is None:
        return "needs nsys"
    if not os.environ.get(driver.LIBS_ENV):
        return f"needs {driver.LIBS_ENV} (the libdw1/libelf1 .deb files, e.g. .carry/debs)"
    return None


@pytest.mark.gpu
def test_layer_profile_under_nsys_has_device_time_per_stage(tmp_path):
    why = _nsys_ready()
    if why:
        pytest.skip(why)
    proc, res = _profile_cli(tmp_path, "--device", "cuda", "--set", "num_tokens=1024",
                             "--set", "num_local_experts=32", timeout=1200)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["mode"] == "nsys" and res["error"] is None and res["launch"] == EAGER_LAUNCHES, res.get("error")
    by = {s["range"]: s for s in res["summary"]}
    for s in STAGES:
        row = by[f"{POINT}/{s}"]
        assert row["count"] == 2 and row["device_total_us"] and row["device_total_us"] > 0, row
    assert by[f"{POINT}/experts"]["kernels"], by[f"{POINT}/experts"]
    assert sum(by[f"{POINT}/{s}"]["device_share"] for s in STAGES) == pytest.approx(1.0, abs=0.02)
