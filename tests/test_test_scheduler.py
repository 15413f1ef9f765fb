"""tests/conftest.py's xdist scheduling: the files that share a warm-up run on one worker, every file on one worker,
every test once under its own id; each run records every unit's time in pytest's cache and the next run hands the
units out longest first (no cache: file order). Run on a copy of the conftest over stand-in files, with a stand-in
`torch` beside it (the conftest asks torch only whether there is a GPU): six interpreter starts of the two runs
(controller and two workers each) would otherwise each import the real torch for that one answer."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import conftest

TESTS = Path(__file__).parent
# Stand-in files in collection (path) order; the gloo_pool pair is one unit, test_zz the slowest unit but last.
SLEEP_S = {"dispatch/test_dispatch.py": 0.02, "inputs/test_padding.py": 0.02, "test_aa.py": 0.02,
           "test_faults.py": 0.02, "test_mm.py": 0.02, "test_zz.py": 0.15}
PER_FILE = 5
# found first on the copy's sys.path (pytest puts the conftest's folder there): no CUDA, as on the CPU machines
STANDIN_TORCH = """\
class cuda:
    @staticmethod
    def is_available():
        return False

    @staticmethod
    def device_count():
        return 0
"""


def test_shared_groups_name_files_that_exist():
    # a moved file would silently leave its group (its warm-up then paid twice)
    for files in conftest.SHARED_GROUPS.values():
        for name in files:
            assert (TESTS / name).is_file(), name


def _run(root: Path, files=SLEEP_S) -> list[tuple[str, str, str]]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "tests"], cwd=root, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (tests/\S+)::(test_\d+)", proc.stdout, re.M)
    expected = [(f"tests/{name}", f"test_{i}") for name in files for i in range(PER_FILE if name in SLEEP_S else 1)]
    assert sorted((f, t) for _, f, t in ran) == sorted(expected)  # each once, plain ids
    return ran


def _units_per_worker(ran) -> dict[str, list[str]]:
    order: dict[str, list[str]] = {}
    for worker, path, _ in ran:
        unit = conftest._GROUP_OF_FILE.get(path[len("tests/"):], path[len("tests/"):])
        if unit not in order.setdefault(worker, []):
            order[worker].append(unit)
    return order


def test_two_workers_take_the_shared_group_whole_and_the_longest_first_from_the_last_run(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(TESTS / "conftest.py", tests)
    (tests / "torch.py").write_text(STANDIN_TORCH)
    shutil.copytree(TESTS / "_site", tests / "_site")
    for name, sleep_s in SLEEP_S.items():
        (tests / name).parent.mkdir(exist_ok=True)
        (tests / name).write_text("import time\n" + "".join(
            f"def test_{i}():\n    time.sleep({sleep_s})\n" for i in range(PER_FILE)))
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -n 2 --dist loadfile --no-loadscope-reorder\n")

    first = _run(tmp_path)  # no cache: file order, so test_zz (last) starts neither worker
    worker_of = {}
    for worker, path, _ in first:
        worker_of.setdefault(path, set()).add(worker)
    assert all(len(w) == 1 for w in worker_of.values()), worker_of  # a file on one worker
    assert worker_of["tests/dispatch/test_dispatch.py"] == worker_of["tests/inputs/test_padding.py"]  # gloo_pool
    assert all(units[0] != "test_zz.py" for units in _units_per_worker(first).values())

    cache = tmp_path / ".pytest_cache" / "v" / conftest.DURATIONS_KEY
    recorded = json.loads(cache.read_text())
    assert set(recorded) == {"gloo_pool", "test_aa.py", "test_faults.py", "test_mm.py", "test_zz.py"}
    assert max(recorded, key=recorded.get) == "test_zz.py"

    (tests / "test_new.py").write_text("def test_0():\n    pass\n")  # no recorded time yet
    second = _run(tmp_path, [*SLEEP_S, "test_new.py"])
    # the unit with no time first (its length unknown), then the slowest of the last run
    assert sorted(units[0] for units in _units_per_worker(second).values()) == ["test_new.py", "test_zz.py"]
    assert len({w for w, path, _ in second if path in (
        "tests/dispatch/test_dispatch.py", "tests/inputs/test_padding.py")}) == 1
