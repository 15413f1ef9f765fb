"""moebench: benchmark and profiling suite for Mixture-of-Experts layers with padded token batches."""

__version__ = "0.1.0"
