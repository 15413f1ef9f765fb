"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.kernels.apply_expert_map  # noqa: F401
import moebench.kernels.globalize_recv_topk_idx  # noqa: F401
