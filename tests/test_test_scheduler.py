"""tests/conftest.py's xdist scheduling: the files that share a warm-up run on one worker, every file on one worker,
every test once under its own id, the longest units first. Run on a copy of the conftest over stand-in files."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import conftest

TESTS = Path(__file__).parent
# collected in this (file-name) order; LONGEST_FIRST puts test_faults first and the gloo_pool pair next
FILES = ("test_aa.py", "test_dispatch.py", "test_faults.py", "test_padding.py")
PER_FILE = 6


def test_shared_groups_and_order_name_files_that_exist():
    # a renamed file would silently leave its group (its warm-up then paid twice) or the order
    for unit in conftest.LONGEST_FIRST:
        assert unit in conftest.SHARED_GROUPS or (TESTS / unit).is_file(), unit
    for files in conftest.SHARED_GROUPS.values():
        for name in files:
            assert (TESTS / name).is_file(), name


def test_two_workers_take_the_shared_group_whole_and_the_longest_first(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(TESTS / "conftest.py", tests)
    shutil.copytree(TESTS / "_site", tests / "_site")
    for name in FILES:
        (tests / name).write_text("import time\n" + "".join(
            f"def test_{i}():\n    time.sleep(0.05)\n" for i in range(PER_FILE)))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "tests"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (tests/\S+)::(test_\d+)", proc.stdout, re.M)
    assert sorted((f, t) for _, f, t in ran) == sorted(
        (f"tests/{name}", f"test_{i}") for name in FILES for i in range(PER_FILE))  # each once, plain ids
    worker_of = {}
    for worker, path, _ in ran:
        worker_of.setdefault(path, set()).add(worker)
    assert all(len(w) == 1 for w in worker_of.values()), worker_of  # a file on one worker
    assert worker_of["tests/test_dispatch.py"] == worker_of["tests/test_padding.py"]  # the gloo_pool unit
    assert worker_of["tests/test_faults.py"] != worker_of["tests/test_dispatch.py"]  # the first two units, spread
    assert ran[0][1] in ("tests/test_faults.py", "tests/test_dispatch.py")  # test_aa (unranked) comes last
