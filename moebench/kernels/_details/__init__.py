"""Helpers shared by the kernels of `moebench.kernels` (launch-side checks, jit utilities). Part of the library:
imports nothing of the benchmark harness."""
