"""A short reference measurement of the machine, taken at a run's start and end and kept in its manifest.

Two fixed workloads that depend on nothing of moebench, so that two runs' figures can be told apart from the
machines they ran on (`moebench compare` reads them: moebench.report.machine):
  matmul_us  one fp32 matmul of fixed shape (compute)
  copy_us    one copy of a fixed-size buffer (memory bandwidth)
Each is the median over a few batches of back-to-back calls (synchronized on a GPU), per call. On a CPU the whole
takes well under a second; on a GPU a few milliseconds. Anything else loading the machine (another process on the
cores, a throttled clock) shows in both numbers.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time

import torch

# (matmul size, copy elements, calls per batch) per device type: small enough to be quick, large enough that the
# timer's resolution and the launch overhead are a small part of a batch
SHAPES = {"cpu": (128, 1 << 19, 8), "cuda": (2048, 1 << 26, 20)}
BATCHES = 5


def _per_call_us(fn, calls: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(calls):  # warm-up: first-call allocation, thread pools, kernel selection
        fn()
    sync()
    times = []
    for _ in range(BATCHES):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def machine_reference(device: torch.device | str) -> dict:
    """{matmul_us, copy_us, workload, device, utc} measured now on `device`."""
    device = torch.device(device)
    size, elements, calls = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.rand(size, size, generator=gen).to(device)
    b = torch.rand(size, size, generator=gen).to(device)
    out = torch.empty(size, size, device=device)
    src = torch.rand(elements, generator=gen).to(device)
    dst = torch.empty_like(src)
    return {"matmul_us": round(_per_call_us(lambda: torch.matmul(a, b, out=out), calls, device), 3),
            "copy_us": round(_per_call_us(lambda: dst.copy_(src), calls, device), 3),
            "workload": f"fp32 matmul {size}x{size}x{size}; copy of {elements * 4 // (1 << 20)} MiB",
            "device": str(device), "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
