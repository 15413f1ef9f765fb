"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.moe_align_block_size  # noqa: F401
