"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.prepare_moe_inputs  # noqa: F401
