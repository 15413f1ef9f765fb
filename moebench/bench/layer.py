"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.layer  # noqa: F401
