"""The scripts under scripts/ import (they broke silently once when the package moved), answer --help, and hold
no timer and no roof of their own: timing is moebench.measure's, roofs are moebench.measure.roofline's."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.report.table import print_rows

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


# Every script's `SCRIPT --help` in one fresh process (runpy, as __main__): one interpreter start, not one each.
HELP_ALL = """\
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path[0] = os.path.dirname(path)  # as `python SCRIPT` has it, not the current directory
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code, _ = 1, err.write(traceback.format_exc())
    results[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps():
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], capture_output=True, text=True,
                          timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_and_answers_help(helps, script):
    res = helps[str(script)]
    assert res["code"] == 0, res["stderr"][-2000:]
    assert "usage" in res["stdout"]


# A timer records a clock itself; a script's Events that are waited on (not read for a time) are not timers.
TIMER = re.compile(r"perf_counter|elapsed_time|time\.time_ns|enable_timing|do_bench")
ROOF = re.compile(r"4247|4\.247e12|714e12|714\.0e12|1428e12")


@pytest.mark.parametrize("script", SCRIPTS + sorted((REPO / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_no_timer_or_roof_constant_in_scripts(script):
    text = script.read_text()
    assert not TIMER.findall(text), f"{script.name} times by itself: use moebench.measure"
    assert not ROOF.findall(text), f"{script.name} holds a roof constant: use moebench.measure.roofline"


def test_no_roof_constant_outside_roofline():
    hits = [str(p.relative_to(REPO)) for p in (REPO / "moebench").rglob("*.py")
            if p.name != "roofline.py" and ROOF.search(p.read_text())]
    assert hits == []


def test_print_rows_aligns_columns_and_dashes_missing_values(capsys):
    print_rows(["path", "p50_us", "note"], [["a2a", 403.21, "ok"], ["deepep", None, "skipped"],
                                            ["agrs", float("nan"), ""]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# path") and "p50_us" in lines[0]
    assert lines[1].split() == ["a2a", "403.2", "ok"] and lines[2].split() == ["deepep", "-", "skipped"]
    # numbers right-aligned: the second column ends at the same place on every row
    assert len({line.index(line.split()[1]) + len(line.split()[1]) for line in lines[1:]}) == 1
