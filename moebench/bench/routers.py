"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.topk_softmax  # noqa: F401
import moebench.kernels.grouped_topk  # noqa: F401
