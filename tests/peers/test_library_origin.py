"""peers._lib.Library: the installed module first, else a copy bundled in another package (vLLM's third_party),
aliased under the top-level name its own modules import; the record's adapter_status names the copy and version."""

import sys

import pytest

from moebench.peers._lib import Library

TOP = "moebench_test_vendored_lib"


@pytest.fixture(name="bundle")
def a_package_bundling_the_library(tmp_path, monkeypatch):
    copy = tmp_path / "moebench_test_bundle" / "third_party" / TOP
    copy.mkdir(parents=True)
    (tmp_path / "moebench_test_bundle" / "__init__.py").write_text("")
    (tmp_path / "moebench_test_bundle" / "third_party" / "__init__.py").write_text("")
    # the copy imports its own submodule by the top-level name, as vLLM's bundled triton_kernels does
    (copy / "__init__.py").write_text("__version__ = '2.8.1'\n")
    (copy / "ops.py").write_text(f"from {TOP} import __version__ as seen\n\ndef gemm():\n    return seen\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"moebench_test_bundle.third_party.{TOP}"
    for name in [n for n in sys.modules if n.startswith((TOP, "moebench_test_bundle"))]:
        del sys.modules[name]


def _load():
    import importlib

    return importlib.import_module(f"{TOP}.ops")


def test_the_bundled_copy_runs_when_none_is_installed(bundle):
    lib = Library("vendlib", TOP, _load, vendored=("moebench_no_such_bundle.x", bundle))
    assert lib.reason is None
    assert lib.get().gemm() == "2.8.1"
    assert lib.origin["copy"] == "vendored" and lib.origin["module"] == bundle
    status = lib.status()
    assert status.startswith(f"real vendlib 2.8.1, vendored copy {bundle} (") and TOP in status


def test_neither_installed_nor_bundled_says_where_it_looked():
    lib = Library("vendlib", TOP, _load, vendored=("moebench_no_such_bundle.third_party.x",))
    assert lib.get() is None
    assert lib.reason == (f"vendlib is not installed (no module {TOP!r} or "
                          "'moebench_no_such_bundle.third_party.x')")
    assert lib.status().startswith("vendlib not loaded")


def test_a_namespace_directory_is_not_the_library(tmp_path, monkeypatch):
    """A directory named like the library without __init__.py (vLLM's third_party copied alone) is not it."""
    (tmp_path / TOP / "third_party").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = Library("vendlib", TOP, _load)
    assert lib.get() is None and lib.reason.startswith("vendlib is not installed")


def test_the_installed_module_comes_first(bundle, tmp_path):
    (tmp_path / TOP).mkdir()
    (tmp_path / TOP / "__init__.py").write_text("__version__ = '9.0'\n")
    (tmp_path / TOP / "ops.py").write_text("def gemm():\n    return 'installed'\n")
    lib = Library("vendlib", TOP, _load, vendored=(bundle,))
    assert lib.get().gemm() == "installed"
    assert lib.origin["copy"] == "installed" and lib.status().startswith("real vendlib 9.0, installed copy")
