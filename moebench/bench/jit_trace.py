"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.jit_trace  # noqa: F401
