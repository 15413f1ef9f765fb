"""Transitional: registrations still live in the modules imported here (moved by the redesign)."""
import moebench.simulate  # noqa: F401
