"""Measurements taken around each point: latency (`timing`), Triton JIT compiles (`jit`) and token imbalance
across experts and EP ranks (`imbalance`). Submodules are imported on use (jit loads triton lazily)."""
