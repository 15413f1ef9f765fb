"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.fused_experts  # noqa: F401
