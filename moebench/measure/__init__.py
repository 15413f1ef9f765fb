"""Measurements taken around each point: latency (`timing`), GPU kernel time from torch.profiler (`kernel_time`),
Triton JIT compiles (`jit`), token imbalance across experts and EP ranks (`imbalance`), NVTX ranges (`nvtx`) and the
roofs (`roofline`). Submodules are imported on use (jit loads triton lazily)."""
