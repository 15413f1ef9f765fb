"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.masked_moe_sum  # noqa: F401
