"""Packaging beyond pyproject.toml: the bundled sweeps (top-level sweeps/) ship inside the wheel as the data-only
package moebench._sweeps, so that `moebench run quickstart` works from a non-editable install."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["moebench", "moebench.*"]) + ["moebench._sweeps"],
    package_dir={"moebench._sweeps": "sweeps"},
    package_data={"moebench._sweeps": ["*.yaml"]},
)
