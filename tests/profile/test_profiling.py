"""NVTX ranges, nsys discovery, the torch.profiler per-range summary and the profile_point driver."""

from __future__ import annotations

import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest
import torch

from moebench.measure import nvtx
from moebench.measure.nvtx import nvtx_range, range_name
from moebench.profile import (add_breakdown, driver, format_summary, summarize_nsys_csv, summarize_trace,
                              write_summary_csv)


@pytest.fixture(autouse=True)
def _fresh_caches():
    driver.find_nsys.cache_clear()
    yield
    driver.find_nsys.cache_clear()


def test_range_name():
    assert range_name("router", "topk_softmax.triton") == "moebench/router/topk_softmax.triton"
    assert range_name("", "masked_moe_sum.oblivious") == "moebench/masked_moe_sum/masked_moe_sum.oblivious"
    with pytest.raises(ValueError):
        range_name("router", "")


@pytest.mark.parametrize("prefer", ["nvtx", "torch", "none"])
def test_nvtx_range_without_cuda(prefer, monkeypatch):
    name, push, pop = nvtx._select_backend(prefer)
    assert name in ("nvtx", "torch.cuda.nvtx", "none")
    if prefer == "none" or not torch.cuda.is_available():
        assert name != "torch.cuda.nvtx"  # torch.cuda.nvtx only ever on CUDA
    monkeypatch.setattr(nvtx, "_backend", lambda: (name, push, pop))
    x = torch.randn(8, 8)
    with nvtx_range(range_name("router", "x.torch")) as r:
        with nvtx_range("moebench/inner/y.torch"):
            y = x @ x
    assert r.name == "moebench/router/x.torch" and torch.isfinite(y).all()
    # an exception inside the block propagates and the range is still closed
    with pytest.raises(RuntimeError, match="boom"):
        with nvtx_range("moebench/raise/z.torch"):
            raise RuntimeError("boom")


def test_nvtx_range_counts_push_pop(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(nvtx, "_backend",
                        lambda: ("fake", lambda n: calls.append("push " + n), lambda: calls.append("pop")))
    with nvtx_range("moebench/a/b.c"):
        with pytest.raises(KeyError):
            with nvtx_range("moebench/d/e.f"):
                raise KeyError("x")
    assert calls == ["push moebench/a/b.c", "push moebench/d/e.f", "pop", "pop"]


def test_real_backend_is_usable():
    assert nvtx.nvtx_backend() in ("nvtx", "torch.cuda.nvtx", "none")
    with nvtx_range("moebench/smoke/x.torch"):
        pass


def test_find_nsys_none_or_executable():
    path = driver.find_nsys()
    assert path is None or (os.path.isfile(path) and os.access(path, os.X_OK))


def test_importing_the_cli_loads_no_triton_kernel():
    """The CLI chooses Triton's interpreter (TRITON_INTERPRET) for a CPU run in main(), and a kernel is decorated
    for the interpreter or for the GPU when its module loads: so importing moebench.cli must load no kernel, or
    `moebench profile` and `run --in-process` on a CPU fail in the kernels ('0 active drivers')."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, moebench.cli; print(sorted(m for m in sys.modules "
            "if m.startswith('moebench.kernels') or m.startswith('moebench.dispatch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_nsys_on_path_then_globs(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEBENCH_NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(driver, "NSYS_GLOBS", (str(tmp_path / "opt" / "**" / "target-linux-x64" / "nsys"),))
    assert driver.find_nsys() is None
    # non-executable file is not taken
    noexec = tmp_path / "opt" / "ncu" / "2024.1.0" / "target-linux-x64" / "nsys"
    noexec.parent.mkdir(parents=True)
    noexec.write_text("")
    driver.find_nsys.cache_clear()
    assert driver.find_nsys() is None
    old = _fake_exe(tmp_path / "opt" / "ncu" / "2024.6.0" / "target-linux-x64" / "nsys")
    new = _fake_exe(tmp_path / "opt" / "ncu" / "2025.3.1" / "host" / "target-linux-x64" / "nsys")
    driver.find_nsys.cache_clear()
    assert driver.find_nsys() == str(new)  # newest version first
    on_path = _fake_exe(tmp_path / "bin" / "nsys")
    monkeypatch.setenv("PATH", str(on_path.parent))
    driver.find_nsys.cache_clear()
    assert driver.find_nsys() == str(on_path)  # PATH wins over the globs
    monkeypatch.setenv("MOEBENCH_NSYS", str(old))
    driver.find_nsys.cache_clear()
    assert driver.find_nsys() == str(old)  # explicit override wins over PATH


def _tiny_workload(iters_a: int, iters_b: int) -> None:
    x = torch.randn(32, 32)
    for _ in range(iters_a):
        with nvtx_range(range_name("router", "topk_softmax.torch")):
            torch.topk(torch.softmax(x @ x, dim=-1), k=4, dim=-1)
    for _ in range(iters_b):
        with nvtx_range(range_name("reduce", "masked_moe_sum.torch")):
            (x * 2).sum(dim=0)
    with torch.autograd.profiler.record_function("unrelated/range"):
        x + 1


def test_summary_of_a_real_cpu_trace(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    _tiny_workload(1, 1)  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _tiny_workload(5, 3)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    summary = summarize_trace(trace)
    by = {s["range"]: s for s in summary}
    assert list(by) == ["moebench/router/topk_softmax.torch", "moebench/reduce/masked_moe_sum.torch"]
    router, reduce = by["moebench/router/topk_softmax.torch"], by["moebench/reduce/masked_moe_sum.torch"]
    assert router["count"] == 5 and reduce["count"] == 3
    assert router["cpu_total_us"] > 0 and router["cpu_mean_us"] == pytest.approx(router["cpu_total_us"] / 5)
    assert router["device_total_us"] is None and router["kernel_kind"] == "cpu_op"
    router_ops = {k["name"]: k["count"] for k in router["kernels"]}
    # top-level ops only (aten::mm sits inside aten::matmul), once per iteration
    assert router_ops.get("aten::matmul") == 5 and router_ops.get("aten::softmax") == 5
    assert router_ops.get("aten::topk") == 5 and "aten::mm" not in router_ops
    reduce_ops = {k["name"]: k["count"] for k in reduce["kernels"]}
    assert reduce_ops.get("aten::mul") == 3 and reduce_ops.get("aten::sum") == 3
    assert "aten::matmul" not in reduce_ops  # ops are attributed to the range they ran in
    # the same summary from the loaded JSON, and the CSV / table
    assert summarize_trace(json.loads(trace.read_text())) == summary
    csv_path = write_summary_csv(summary, tmp_path / "s.csv")
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("range,count,cpu_total_us")
    assert sum(r.startswith("moebench/router/topk_softmax.torch,5,") for r in rows) == len(router["kernels"])
    table = format_summary(summary)
    assert "moebench/router/topk_softmax.torch" in table and "aten::topk" in table


def test_summary_matches_kernels_by_correlation():
    """GPU-shaped trace (as torch.profiler writes with CUDA activities): kernels reach their range through the
    launching runtime call's correlation id; device time is their sum, the span from gpu_user_annotation."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "moebench/route/a.triton", "ts": 100, "dur": 50, "pid": 1,
         "tid": 7},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 110, "dur": 5, "pid": 1, "tid": 7,
         "args": {"correlation": 11}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 130, "dur": 5, "pid": 1, "tid": 7,
         "args": {"correlation": 12}},
        {"ph": "X", "cat": "user_annotation", "name": "moebench/route/a.triton", "ts": 200, "dur": 50, "pid": 1,
         "tid": 7},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 210, "dur": 5, "pid": 1, "tid": 7,
         "args": {"correlation": 13}},
        # a launch outside any moebench range, and one on another thread inside the time window
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 300, "dur": 5, "pid": 1, "tid": 7,
         "args": {"correlation": 14}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 120, "dur": 5, "pid": 1, "tid": 8,
         "args": {"correlation": 15}},
        {"ph": "X", "cat": "kernel", "name": "_topk_softmax_kernel", "ts": 140, "dur": 8, "pid": 0, "tid": 7,
         "args": {"correlation": 11}},
        {"ph": "X", "cat": "kernel", "name": "_renorm_kernel", "ts": 150, "dur": 2, "pid": 0, "tid": 7,
         "args": {"correlation": 12}},
        {"ph": "X", "cat": "kernel", "name": "_topk_softmax_kernel", "ts": 220, "dur": 9, "pid": 0, "tid": 7,
         "args": {"correlation": 13}},
        {"ph": "X", "cat": "kernel", "name": "_renorm_kernel", "ts": 229, "dur": 2, "pid": 0, "tid": 7,
         "args": {"correlation": 13}},
        {"ph": "X", "cat": "kernel", "name": "other", "ts": 310, "dur": 2, "pid": 0, "tid": 7,
         "args": {"correlation": 14}},
        {"ph": "X", "cat": "kernel", "name": "other_thread", "ts": 160, "dur": 2, "pid": 0, "tid": 7,
         "args": {"correlation": 15}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "moebench/route/a.triton", "ts": 140, "dur": 12,
         "pid": 0, "tid": 7},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "moebench/route/a.triton", "ts": 220, "dur": 11,
         "pid": 0, "tid": 7},
    ]
    (s,) = summarize_trace({"traceEvents": ev})
    assert s["count"] == 2 and s["cpu_total_us"] == 100
    assert s["device_total_us"] == 21 and s["device_source"] == "kernels" and s["device_mean_us"] == 10.5
    assert s["device_span_us"] == 23  # first kernel start to last kernel end, per instance (gpu_user_annotation)
    assert s["kernel_kind"] == "gpu_kernel"
    assert [(k["name"], k["count"], k["total_us"]) for k in s["kernels"]] == \
        [("_topk_softmax_kernel", 2, 17), ("_renorm_kernel", 2, 4)]
    # without the gpu-side annotation the device time is the same, the span unknown
    (s2,) = summarize_trace({"traceEvents": [e for e in ev if e["cat"] != "gpu_user_annotation"]})
    assert s2["device_total_us"] == 21 and s2["device_source"] == "kernels" and s2["device_span_us"] is None


def _cpu_trace_with_interpreted_kernels() -> dict:
    """A torch.profiler-shaped CPU trace: a point range holding two stages; the experts stage runs an interpreted
    Triton launch (a `triton/<kernel>` range with the interpreter's own torch calls inside) and a torch op."""
    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}
    point = "moebench/layer/layer.masked"
    return {"traceEvents": [
        x("user_annotation", point, 0, 1000), x("user_annotation", point + "/route", 10, 190),
        x("user_annotation", "triton/_topk_kernel", 20, 170), x("cpu_op", "aten::set_", 30, 5),
        x("user_annotation", point + "/experts", 210, 780),
        x("user_annotation", "triton/_gate_up_kernel", 220, 600), x("cpu_op", "aten::empty", 230, 4),
        x("cpu_op", "aten::set_", 240, 3), x("cpu_op", "aten::add", 850, 100)]}


def test_cpu_summary_lists_interpreted_kernels_with_wall_shares():
    point = "moebench/layer/layer.masked"
    rows = add_breakdown(summarize_trace(_cpu_trace_with_interpreted_kernels()))
    by = {r["range"]: r for r in rows}
    assert [r["range"] for r in rows] == [point, point + "/route", point + "/experts"]  # triton/ is no range
    experts = by[point + "/experts"]
    # the launch is one item; the torch calls inside it are the interpreter's, not listed
    assert [(k["name"], k["total_us"]) for k in experts["kernels"]] == [("triton/_gate_up_kernel", 600.0),
                                                                         ("aten::add", 100.0)]
    assert [k["name"] for k in by[point + "/route"]["kernels"]] == ["triton/_topk_kernel"]
    assert experts["device_total_us"] is None and experts["device_share"] is None
    assert experts["wall_share"] == pytest.approx(0.78) and by[point + "/route"]["wall_share"] == pytest.approx(0.19)
    assert by[point]["wall_share"] == 1.0
    table = format_summary(rows, header="line one\nline two")
    lines = table.splitlines()
    assert lines[:2] == ["# line one", "# line two"] and "wall total" in lines[2] and "dev total" not in table
    assert next(ln for ln in lines if ln.strip().startswith(point + "/experts ")).endswith("78.0%")


def test_header_says_what_the_figures_are():
    cpu_rows = [{"kernels": [{"name": "triton/_k"}], "device_total_us": None}]
    base = {"mode": "torch.profiler", "device": "cpu", "iterations": 5, "launch": "eager launches"}
    head, how = driver.summary_header({**base, "summary": cpu_rows, "triton_interpret": True,
                                       "interpreted_kernel_ranges": True}).splitlines()
    assert head.startswith("wall time of each range on the host, 5 profiled iterations") and "share" in head
    assert "interpreter times on the CPU, not GPU figures" in how and "triton/<kernel>" in how
    # a plain torch impl under the interpreter: no Triton launch, so no interpreter times to speak of
    torch_rows = [{"kernels": [{"name": "aten::softmax"}], "device_total_us": None}]
    assert driver.summary_header({**base, "summary": torch_rows, "triton_interpret": True,
                                  "interpreted_kernel_ranges": True}).splitlines()[1] == \
        "measured on the CPU: not GPU figures"
    gpu_rows = [{"kernels": [], "device_total_us": 3.0, "device_source": "kernels"}]
    assert driver.summary_header({**base, "device": "cuda", "summary": gpu_rows}) == \
        "device time from eager launches, 5 profiled iterations (torch.profiler kernels)"


def test_interpreted_kernel_launches_become_ranges_only_inside_the_block(monkeypatch):
    import triton
    import triton.language as tl
    from torch.profiler import ProfilerActivity, profile

    from moebench.profile.interpreted import interpreted_kernel_ranges

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs Triton's interpreter")

    @triton.jit
    def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    x = torch.ones(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _double_kernel[(1,)](x, 8, BLOCK=8)  # outside the block: no range
        with interpreted_kernel_ranges() as active:
            _double_kernel[(1,)](x, 8, BLOCK=8)
    assert active and InterpretedFunction.run is original and torch.equal(x, torch.full((8,), 4.0))
    names = [e.name for e in prof.events()]
    assert names.count("triton/_double_kernel") == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels: nothing to wrap
    with interpreted_kernel_ranges() as active:
        assert not active and InterpretedFunction.run is original


NVTX_SUM = """Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
80.0,400000,20,20000.0,19000.0,18000,30000,1000.0,PushPop,:moebench/experts/fused_experts.triton
20.0,100000,20,5000.0,5000.0,4000,7000,500.0,PushPop,:other/range
"""
NVTX_KERN_SUM = """NVTX Range,Style,PID,TID,NVTX Inst,Kern Inst,Total Time (ns),Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Kernel Name
:moebench/experts/fused_experts.triton,PushPop,1,1,20,20,300000,15000.0,15000.0,14000,16000,100.0,_grouped_gemm_kernel
:moebench/experts/fused_experts.triton,PushPop,1,1,20,40,60000,1500.0,1500.0,1400,1600,10.0,_silu_mul_kernel
"""


def test_nsys_csv_summary(tmp_path):
    """Parser for `nsys stats --format csv` output (column layout of nsys 2024-2025; checked for real on the GPU
    by test_profile_point_gpu)."""
    (tmp_path / "profile_nvtx_sum.csv").write_text(NVTX_SUM)
    (tmp_path / "profile_nvtx_kern_sum.csv").write_text(NVTX_KERN_SUM)
    (s,) = summarize_nsys_csv(tmp_path / "profile_nvtx_sum.csv", tmp_path / "profile_nvtx_kern_sum.csv",
                              tmp_path / "absent.csv")
    assert s["range"] == "moebench/experts/fused_experts.triton" and s["count"] == 20
    assert s["cpu_total_us"] == 400.0 and s["cpu_mean_us"] == 20.0
    assert [(k["name"], k["count"], k["total_us"]) for k in s["kernels"]] == \
        [("_grouped_gemm_kernel", 20, 300.0), ("_silu_mul_kernel", 40, 60.0)]
    assert s["device_total_us"] == 360.0 and s["device_source"] == "nvtx_kern_sum"


def test_nsys_commands():
    cmd = driver.nsys_profile_command("/x/nsys", "sweeps/a.yaml", 3, "/tmp/run", ["top_k=4"], "cuda", 7)
    joined = " ".join(cmd)
    for part in ("profile -t cuda,nvtx -s none --cpuctxsw=none --capture-range=cudaProfilerApi "
                 "--capture-range-end=stop", "-o /tmp/run/profile", "-m moebench profile sweeps/a.yaml --point 3 "
                 "--inner --device cuda --iters 7", "--set top_k=4"):
        assert part in joined
    stats = driver.nsys_stats_command("/x/nsys", "/tmp/run/profile.nsys-rep", "nvtx_sum,cuda_gpu_kern_sum",
                                      "/tmp/run/profile")
    assert stats[:5] == ["/x/nsys", "stats", "--report", "nvtx_sum,cuda_gpu_kern_sum", "--format"]


FAKE_NSYS = """#!{python}
import os, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
if args[0] == "profile":
    open(out + ".nsys-rep", "w").write("rep")
    print("inner:", " ".join(args[args.index("-m"):]))
elif args[0] == "stats":
    if os.environ.get("FAKE_NSYS_FAIL"):
        sys.stderr.write("libdw.so.1: cannot open shared object file: No such file or directory\\n")
        sys.exit(1)
    for report in args[args.index("--report") + 1].split(","):
        text = {{"nvtx_sum": {nvtx!r}, "nvtx_kern_sum": {kern!r}}}.get(report, "Name,Total Time (ns)\\n")
        open(out + "_" + report + ".csv", "w").write(text)
"""


def test_nsys_driver_with_a_fake_nsys(tmp_path, monkeypatch):
    """The nsys path end to end against a stand-in nsys: report kept, CSVs saved, summary parsed; and when
    `nsys stats` fails (libdw missing on the H200 image) the .nsys-rep stays and the error text is recorded."""
    fake = tmp_path / "nsys"
    fake.write_text(FAKE_NSYS.format(python=sys.executable, nvtx=NVTX_SUM, kern=NVTX_KERN_SUM))
    fake.chmod(0o755)
    out = tmp_path / "run"
    out.mkdir()
    (out / "profile_nvtx_sum.csv").write_text("stale")  # an earlier profile's file must not be reused
    res = driver._profile_nsys(str(fake), "sweeps/x.yaml", 1, out, ["top_k=4"], "cuda", 5, timeout_s=60)
    assert res["error"] is None, res["error"]
    assert (out / "profile.nsys-rep").exists() and (out / "profile_cuda_gpu_kern_sum.csv").exists()
    assert "--point 1 --inner --device cuda --iters 5" in (out / "profile_inner.log").read_text()
    (s,) = res["summary"]
    assert s["range"] == "moebench/experts/fused_experts.triton" and s["count"] == 20 and len(s["kernels"]) == 2

    monkeypatch.setenv("FAKE_NSYS_FAIL", "1")
    res = driver._profile_nsys(str(fake), "sweeps/x.yaml", 1, out, None, "cuda", 5, timeout_s=60)
    assert (out / "profile.nsys-rep").exists() and not list(out.glob("profile_*.csv"))
    assert "libdw.so.1" in res["error"] and res["summary"] == []
    assert str(out / "profile.nsys-rep") in res["files"]


def _fake_runner(monkeypatch, reach_timing: bool = True):
    """Stand-in for moebench.run.runner.run_single_point with the agreed signature."""
    seen = {}

    def run_single_point(sweep, point_index, device, iters, inner_hook):
        seen.update(sweep=sweep, point_index=point_index, device=device, iters=iters)
        if not reach_timing:
            return {"status": "wrong", "reason": "out.max_rel 0.5 > 0.01"}
        x = torch.randn(16, 16)
        with nvtx_range(range_name("router", "topk_softmax.torch")):  # warm-up: outside the capture
            x @ x
        inner_hook("start")
        for _ in range(iters):
            with nvtx_range(range_name("router", "topk_softmax.torch")):
                torch.softmax(x @ x, dim=-1)
        inner_hook("stop")
        return {"status": "ok"}

    runner = types.ModuleType("moebench.run.runner")
    runner.run_single_point = run_single_point
    monkeypatch.setitem(sys.modules, "moebench.run.runner", runner)
    point = types.SimpleNamespace(impl="topk_softmax.torch")
    monkeypatch.setattr(driver, "_load_point", lambda path, index, overrides: ("SWEEP", point))
    return seen


def test_profile_point_torch_profiler(tmp_path, monkeypatch, capsys):
    seen = _fake_runner(monkeypatch)
    out = tmp_path / "prof"
    res = driver.profile_point("sweeps/x.yaml", 2, out, ["top_k=4"], "cpu", iters=4, use_nsys=False)
    assert seen == {"sweep": "SWEEP", "point_index": 2, "device": "cpu", "iters": 4}
    assert res["mode"] == "torch.profiler" and res["error"] is None and res["point_status"] == "ok"
    (s,) = res["summary"]
    assert s["range"] == "moebench/router/topk_softmax.torch" and s["count"] == 4  # warm-up not captured
    for name in ("trace.json", "profile_summary.csv", "profile.json"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "profile.json").read_text())["summary"][0]["count"] == 4
    assert "moebench/router/topk_softmax.torch" in capsys.readouterr().out


def test_profile_point_that_never_times(tmp_path, monkeypatch):
    _fake_runner(monkeypatch, reach_timing=False)
    res = driver.profile_point("sweeps/x.yaml", 0, tmp_path, None, "cpu", iters=2, use_nsys=False, echo=False)
    assert res["summary"] == [] and "never reached" in res["error"] and res["point_status"] == "wrong"
    assert "out.max_rel 0.5 > 0.01" in res["error"]  # why it never did


@pytest.mark.gpu
def test_profile_point_gpu(tmp_path):
    """Whole path on a GPU with the real runner: nsys when found (else torch.profiler with CUDA activities)."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: prof\ntarget: router\nimpls: [topk_softmax.triton]\n"
                     "fixed: {num_tokens: 1024, num_experts: 256, top_k: 8, padding_ratio: 0.25}\n"
                     "timing: {mode: events, warmup: 3, iters: 10}\n")
    res = driver.profile_point(sweep, 0, tmp_path / "out", None, "cuda", iters=10)
    print(json.dumps({k: v for k, v in res.items() if k != "summary"}, indent=1, default=str))
    if res.get("nsys_error"):  # nsys wrote no report (no libdw): torch.profiler stood in and the note says why
        assert res["mode"] == "torch.profiler" and "torch.profiler used instead" in res["note"], res
    if res["mode"] == "nsys":
        assert (tmp_path / "out" / "profile.nsys-rep").exists()
        if res["error"]:  # nsys stats unusable (libdw missing): the report is kept and the error says why
            pytest.skip(f"nsys stats failed: {res['error'][:300]}")
    assert res["error"] is None, res["error"]
    (s,) = [s for s in res["summary"] if s["range"] == "moebench/topk_softmax/topk_softmax.triton"
            or s["range"].endswith("/topk_softmax.triton")]
    assert s["count"] == 10 and s["kernels"], s


def test_profile_point_falls_back_when_nsys_writes_no_report(tmp_path, monkeypatch):
    """nsys present but its importer fails (no libdw on the H200 image): no .nsys-rep, so the point is profiled
    with torch.profiler instead and the result says why."""
    calls = []
    monkeypatch.setattr(driver, "find_nsys", lambda *a, **k: "/fake/nsys")
    monkeypatch.setattr(driver, "_load_point", lambda *a, **k: ("SWEEP", None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(driver, "_profile_nsys", lambda *a, **k: calls.append("nsys") or {
        "mode": "nsys", "files": [str(tmp_path / "profile_inner.log")], "summary": [],
        "error": "nsys profile rc=0: Importer error status: An unknown error occurred."})
    monkeypatch.setattr(driver, "_profile_torch", lambda *a, **k: calls.append("torch") or {
        "mode": "torch.profiler", "files": [], "summary": [], "error": None})
    res = driver.profile_point("s.yaml", 0, tmp_path, None, "cuda", iters=2, echo=False)
    assert calls == ["nsys", "torch"]
    assert res["mode"] == "torch.profiler" and res["error"] is None
    assert "Importer error" in res["nsys_error"] and "torch.profiler used instead" in res["note"]
    assert str(tmp_path / "profile_inner.log") in res["files"]
    assert json.loads((tmp_path / "profile.json").read_text())["nsys_error"].startswith("nsys profile rc=0")
