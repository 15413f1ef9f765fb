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


# How pyproject's `-n 2 --dist loadfile` shares the files between the two workers (pytest_xdist_make_scheduler below):
# one file a unit of work, so a module fixture runs once, except files that share a per-process warm-up, which go to
# one worker together: torch.compile's first compile (inductor's start, 8-20 s on a CI core) and the session's pool
# of gloo ranks (four interpreter starts, tests/gloo_pool.py). Paths relative to tests/.
SHARED_GROUPS = {
    "inductor": ("test_bench_contract.py", "test_peers.py", "test_peers_torch_grouped.py"),
    "gloo_pool": ("test_dispatch.py", "test_dispatch_paths.py", "test_padding.py", "test_timing.py"),
}
_GROUP_OF_FILE = {f: g for g, files in SHARED_GROUPS.items() for f in files}
# The longest units first (seconds of test time on a 2-core CI machine, measured 2026-12-02), so that the two
# workers finish together: each worker takes the next unit in this order when it runs dry (xdist hands each two at
# the start); the rest follow in file order. A stale list costs only balance.
LONGEST_FIRST = ("test_faults.py", "test_point_isolation.py", "gloo_pool", "inductor", "test_serving_trace.py",
                 "kernels/test_topk_softmax.py", "test_bench_layer_fp8.py", "test_scenarios.py", "test_install.py",
                 "test_plots.py", "test_runner_multirank.py", "kernels/test_router_cand.py", "test_bench_ep_sim.py",
                 "test_dist.py", "kernels/test_fused_experts_fp8.py", "test_bench_layer.py")
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _work_unit(config, nodeid: str) -> str:
    """The unit of work of a test id: its file relative to tests/, or the shared group that file belongs to."""
    path = os.path.relpath(os.path.join(str(config.rootpath), nodeid.split("::", 1)[0]), _TESTS_DIR)
    return _GROUP_OF_FILE.get(path.replace(os.sep, "/"), path)


def _grouped(config) -> bool:
    return config.getvalue("dist") == "loadfile"


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: only called where pytest-xdist is installed
def pytest_configure_node(node):
    # xdist sends a worker indices into the worker's own collection, so the order must be the workers' own: they
    # sort what they collect (pytest_collection_modifyitems), and the scheduler keeps that order
    node.workerinput["moebench_longest_first"] = _grouped(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if not _grouped(config):
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadFileScheduling

    class SharedWarmupScheduling(LoadFileScheduling):
        """xdist's loadfile with SHARED_GROUPS as single units, taken in the workers' collection order (LONGEST_FIRST,
        with `--no-loadscope-reorder`). The test ids stay xdist's plain ones (`--lf` and a pasted failing id work);
        `-n 0` and `--dist load` keep the file order."""

        def _split_scope(self, nodeid):
            return _work_unit(self.config, nodeid)

    return SharedWarmupScheduling(config, log)


def _longest_first(config, items) -> None:
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(config, item.nodeid), len(rank)))  # stable: file order after


def pytest_collection_modifyitems(config, items):
    import torch

    if getattr(config, "workerinput", {}).get("moebench_longest_first"):
        _longest_first(config, items)
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
