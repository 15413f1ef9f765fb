"""tests/_site/sitecustomize.py's guard: its Triton interpreter patches load only on a Triton version each was
checked against, unless MOEBENCH_TEST_UNCHECKED_TRITON=1 opts out."""
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

SITECUSTOMIZE = Path(__file__).resolve().parent / "_site" / "sitecustomize.py"


def _load(name: str):
    """A fresh copy of the module, run from its file (its top level checks the installed Triton's version)."""
    spec = importlib.util.spec_from_file_location(name, SITECUSTOMIZE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loading_on_an_unchecked_triton_fails_naming_the_patches_and_the_version(monkeypatch):
    monkeypatch.delenv("MOEBENCH_TEST_UNCHECKED_TRITON", raising=False)
    monkeypatch.delenv("MOEBENCH_TEST_NO_INTERP_FASTPATH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "9.99.0")
    with pytest.raises(RuntimeError) as raised:
        _load("_sitecustomize_on_fake_triton")
    message = str(raised.value)
    assert "Triton 9.99.0" in message and "MOEBENCH_TEST_UNCHECKED_TRITON=1" in message
    for patch in ("_patch_xor_reduce", "_patch_builtin_names", "_patch_device_calls", "_memoize_np_dtype"):
        assert patch in message


def test_the_opt_out_and_a_checked_version_pass(monkeypatch):
    monkeypatch.setenv("MOEBENCH_TEST_NO_INTERP_FASTPATH", "1")  # loaded for its functions: nothing patched again
    site = _load("_sitecustomize_checks")
    site.check_triton_version("9.99.0", environ={"MOEBENCH_TEST_UNCHECKED_TRITON": "1"})
    site.check_triton_version(site.installed_triton_version(), environ={})
    with pytest.raises(site.UncheckedTritonError, match="_memoize_np_dtype"):
        site.check_triton_version("9.99.0", environ={})


def test_a_gpu_run_neither_checks_nor_patches(monkeypatch):
    # GPU machines run another Triton, compiled: the interpreter is never called there
    monkeypatch.delenv("MOEBENCH_TEST_UNCHECKED_TRITON", raising=False)
    monkeypatch.delenv("MOEBENCH_TEST_NO_INTERP_FASTPATH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "9.99.0")
    _load("_sitecustomize_on_a_gpu_run")
