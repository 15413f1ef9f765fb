"""Packaging beyond pyproject.toml: the bundled sweeps (sweeps/*.yaml and the scenarios, sweeps/scenarios/*.yaml)
ship inside the wheel as the data-only package moebench._sweeps, so that `moebench run quickstart` (or a scenario
by name) works from a non-editable install; the example serving traces (moebench/traces/data/*.csv) ship as package
data of moebench.traces."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["moebench", "moebench.*"]) + ["moebench._sweeps"],
    package_dir={"moebench._sweeps": "sweeps"},
    package_data={"moebench._sweeps": ["*.yaml", "scenarios/*.yaml"], "moebench.kernels": ["tuned/*.json"],
                  "moebench.traces": ["data/*.csv"]},
)
