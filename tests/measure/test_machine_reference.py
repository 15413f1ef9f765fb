"""moebench.measure.machine_reference at the shapes it ships with: tests/conftest.py gives the suite's own runs a
quicker CPU workload, so this is where the shipped one is measured."""

import conftest
import torch

from moebench.measure import machine_reference as mr


def test_the_shipped_cpu_workload_is_measured(monkeypatch):
    size, elements, calls = conftest.SHIPPED_MACHINE_REFERENCE_SHAPES["cpu"]
    monkeypatch.setitem(mr.SHAPES, "cpu", (size, elements, calls))
    ref = mr.machine_reference(torch.device("cpu"))
    assert ref["matmul_us"] > 0 and ref["copy_us"] > 0 and ref["device"] == "cpu" and ref["utc"]
    assert ref["workload"] == f"fp32 matmul {size}x{size}x{size}; copy of {elements * 4 // (1 << 20)} MiB"
    assert (size, elements, calls) != conftest.QUICK_MACHINE_REFERENCE_CPU
