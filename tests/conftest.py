import json
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


# Every run moebench records measures the machine at its start and end (moebench.measure.machine_reference; on the CPU
# a 128^3 matmul and a copy of 2 MiB, 48 calls each): 0.3-0.5 s of a 2-core machine a run, and the suite makes some
# 140 runs in its own processes. Those measure a 16^3 matmul and a copy of 1 MiB, once a batch: the manifests keep
# both ends, each with its figures and workload, as before. The shipped shapes are measured in
# tests/measure/test_machine_reference.py; a run the tests start as a process of its own (the CLI in a subprocess)
# keeps them.
QUICK_MACHINE_REFERENCE_CPU = (16, 1 << 18, 1)


def _quick_machine_reference() -> dict | None:
    """The shipped SHAPES (None when moebench cannot be imported), after setting the quick CPU workload."""
    try:
        from moebench.measure import machine_reference
    except ImportError:  # pragma: no cover - a stand-in environment (tests/test_test_scheduler.py)
        return None
    shipped = dict(machine_reference.SHAPES)
    machine_reference.SHAPES["cpu"] = QUICK_MACHINE_REFERENCE_CPU
    return shipped


SHIPPED_MACHINE_REFERENCE_SHAPES = _quick_machine_reference()


# How pyproject's `-n 2 --dist loadfile` shares the files between the two workers (pytest_xdist_make_scheduler below):
# one file a unit of work, so a module fixture runs once, except files that share a per-process warm-up, which go to
# one worker together: torch.compile's first compile (inductor's start) and the session's pool of gloo ranks (four
# interpreter starts, tests/gloo_pool.py). Paths relative to tests/.
SHARED_GROUPS = {
    "inductor": ("bench/test_bench_contract.py", "peers/test_peers.py", "peers/test_peers_torch_grouped.py"),
    "gloo_pool": ("dispatch/test_dispatch.py", "dispatch/test_dispatch_paths.py", "inputs/test_padding.py",
                  "measure/test_timing.py"),
}
_GROUP_OF_FILE = {f: g for g, files in SHARED_GROUPS.items() for f in files}
# The units are handed out longest first, so that the two workers finish together: each unit's seconds of test time
# in the last run that ran it, kept in pytest's cache (.pytest_cache) under this key and written at the end of every
# run. A fresh clone (CI) has no cache: it reads the times a whole run wrote into UNIT_DURATIONS_FILE (rewritten by
# any run with MOEBENCH_RECORD_DURATIONS=1: a run's output, never edited by hand; stale times only cost balance).
# Units with no recorded time (a new file, or any file where the times are older than it) go first, in file order:
# their length is unknown, and a long one handed out last would finish alone (the known short units make the tail).
DURATIONS_KEY = "moebench/unit_durations"
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
UNIT_DURATIONS_FILE = os.path.join(_TESTS_DIR, "unit_durations.json")


def _work_unit(config, nodeid: str) -> str:
    """The unit of work of a test id: its file relative to tests/, or the shared group that file belongs to."""
    path = os.path.relpath(os.path.join(str(config.rootpath), nodeid.split("::", 1)[0]), _TESTS_DIR)
    return _GROUP_OF_FILE.get(path.replace(os.sep, "/"), path.replace(os.sep, "/"))


def _grouped(config) -> bool:
    return config.getvalue("dist") == "loadfile"


def _recorded_durations(config) -> dict:
    cache = getattr(config, "cache", None)
    got = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    if not got and os.path.isfile(UNIT_DURATIONS_FILE):
        with open(UNIT_DURATIONS_FILE) as f:
            got = json.load(f)
    return got if isinstance(got, dict) else {}


class _UnitDurations:
    """Sums each unit's test time (setup, call, teardown) as the reports come in and adds them to the cache at the
    end. Registered on the controller or in a `-n 0` run, never on an xdist worker (xdist relays the workers'
    reports to the controller; a worker's sums would be its share only)."""

    def __init__(self, config):
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        unit = _work_unit(self.config, report.nodeid)
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if self.seconds:
            recorded = _recorded_durations(self.config)  # a run of a few files keeps the others' times
            recorded.update({unit: round(s, 3) for unit, s in self.seconds.items()})
            self.config.cache.set(DURATIONS_KEY, recorded)
            if os.environ.get("MOEBENCH_RECORD_DURATIONS") == "1":
                with open(UNIT_DURATIONS_FILE, "w") as f:
                    json.dump(dict(sorted(recorded.items())), f, indent=1)
                    f.write("\n")


def pytest_configure(config):
    if getattr(config, "cache", None) is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_UnitDurations(config), "moebench_unit_durations")


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: only called where pytest-xdist is installed
def pytest_configure_node(node):
    # xdist sends a worker indices into the worker's own collection, so the order must be the workers' own: they
    # sort what they collect (pytest_collection_modifyitems) by the durations handed to them here, and the
    # scheduler keeps that order
    if _grouped(node.config):
        node.workerinput["moebench_unit_durations"] = _recorded_durations(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if not _grouped(config):
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadFileScheduling

    class SharedWarmupScheduling(LoadFileScheduling):
        """xdist's loadfile with SHARED_GROUPS as single units, taken in the workers' collection order (longest
        first, with `--no-loadscope-reorder`). The test ids stay xdist's plain ones (`--lf` and a pasted failing id
        work); `-n 0` and `--dist load` keep the file order."""

        def _split_scope(self, nodeid):
            return _work_unit(self.config, nodeid)

    return SharedWarmupScheduling(config, log)


def _longest_first(config, items, durations: dict) -> None:
    def slowest_first(item):
        unit = _work_unit(config, item.nodeid)
        seconds = durations.get(unit)
        return (1, -seconds, unit) if isinstance(seconds, (int, float)) else (0, 0, "")

    items.sort(key=slowest_first)  # stable: file order within a unit and among the units with no recorded time


def pytest_collection_modifyitems(config, items):
    import torch

    durations = getattr(config, "workerinput", {}).get("moebench_unit_durations")
    if durations:
        _longest_first(config, items, durations)
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
    from tests.gloo_pool import GlooPool

    pool = GlooPool()
    yield pool
    pool.close()
