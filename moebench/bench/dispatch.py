"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.dispatch.bench  # noqa: F401
