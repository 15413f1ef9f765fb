import os

import pytest

# Without a GPU the Triton kernels run in Triton's CPU interpreter; the switch must be set before triton loads.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_fastpath():
    """tests/_site/sitecustomize.py (a numpy xor reduction for Triton's interpreter, see there): loaded here for
    this process, and put on PYTHONPATH for every process the tests start (point worker, gloo ranks, CLI runs)."""
    import importlib.util

    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site] + [p for p in paths if p])
    spec = importlib.util.spec_from_file_location("_moebench_test_sitecustomize", os.path.join(site, "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_interpreter_fastpath()


def pytest_collection_modifyitems(config, items):
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_gpu2 = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
        if "gpu2" in item.keywords and n < 2:
            item.add_marker(skip_gpu2)


@pytest.fixture
def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def gloo_ranks():
    """One pool of gloo ranks (up to 4) for this test process, started at its first use (tests/gloo_pool.py)."""
    from gloo_pool import GlooPool

    pool = GlooPool()
    yield pool
    pool.close()
