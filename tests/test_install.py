"""A non-editable `pip install .` into a fresh venv runs the bundled quickstart: the sweeps (and the scenarios)
ship in the wheel.

The venv is bare (no system site-packages: what the base interpreter happens to hold does not matter); a .pth
file puts the site-packages of the environment running the tests after its own, so torch, pip and the build
backend come from there (the dev extra brings setuptools>=70.1, which builds a wheel by itself) and nothing is
downloaded. The install has no build isolation (pip checks the build requirements instead), no dependencies and
no index, and the commands run from a folder outside the copy, with no PYTHONPATH, so they can only find the
installed package."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "results", "plots", "__pycache__", "*.egg-info", "build", ".venv", ".out",
                              ".whl", ".gl", ".deb")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_RANK")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", TRITON_INTERPRET="1")
    return env


# One interpreter of the venv answers where moebench was found and runs the two dry runs through moebench.cli.main,
# each with its exit code and output (an interpreter start is most of a dry run's time): the same installed copy,
# from the same folder, as `python -m moebench run ... --dry-run` would be. It also runs the installed package's
# __main__ (`python -m moebench --version`, through runpy as `-m` does); the console script runs the quickstart.
PROBE = """\
import contextlib, importlib.util, io, json, runpy, sys
import moebench, moebench.run.paths as p
from moebench.cli import main

out = {"where": [moebench.__file__, str(p.bundled_sweep_dir()), str(p.sweep_argument_path("sp_padding_straggler"))]}
for name, argv in json.loads(sys.argv[1]).items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    out[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
sys.argv, stdout = ["moebench", "--version"], io.StringIO()
with contextlib.redirect_stdout(stdout):
    try:
        runpy.run_module("moebench", run_name="__main__", alter_sys=True)
        code = None
    except SystemExit as e:
        code = e.code
out["-m moebench --version"] = {"code": code, "stdout": stdout.getvalue(),
                                "file": importlib.util.find_spec("moebench.__main__").origin}
print(json.dumps(out))
"""


def _bare_venv_over_this_environment(env_dir: Path) -> Path:
    """A venv without system site-packages whose .pth appends this environment's site-packages to its own."""
    venv.create(env_dir, with_pip=False)
    (own,) = env_dir.glob("lib/python*/site-packages")
    outer = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))  # plain paths: no .pth of theirs runs
    (own / "_test_environment.pth").write_text("".join(f"{d}\n" for d in outer))
    return env_dir / "bin" / "python"


def test_pip_install_runs_bundled_quickstart(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=SKIP)
    env_dir = tmp_path / "venv"
    python = _bare_venv_over_this_environment(env_dir)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--check-build-dependencies", "--no-cache-dir", "--no-compile", str(src)],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    runs = {"dry": ["run", "sp_padding_straggler", "--dry-run", "--device", "cpu"],
            # the bundled example trace is package data: the installed copy finds it by name
            "trace": ["run", "padding_tax", "--dry-run", "--device", "cpu", "--set",
                      "trace_file=example_chat_dp2.csv"]}
    probe = subprocess.run([str(python), "-c", PROBE, json.dumps(runs)], capture_output=True, text=True, timeout=120,
                           env=_env(), cwd=work)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-3000:]
    got = json.loads(probe.stdout.splitlines()[-1])
    module_file, sweep_dir, scenario = got["where"]
    assert Path(module_file).is_relative_to(env_dir), got["where"]  # the installed copy, not the checkout
    assert Path(sweep_dir) == Path(module_file).parent / "_sweeps"
    assert Path(scenario) == Path(sweep_dir) / "scenarios" / "sp_padding_straggler.yaml"  # a scenario, by name
    for name in runs:
        res = got[name]
        assert res["code"] == 0 and "planned" in res["stdout"], name + res["stdout"][-2000:] + res["stderr"][-3000:]
    version = got["-m moebench --version"]
    assert version["code"] == 0 and version["stdout"].startswith("moebench "), version
    assert Path(version["file"]).is_relative_to(env_dir), version
    # the console script, as the README's first command runs it
    run = subprocess.run([str(env_dir / "bin" / "moebench"), "run", "quickstart", "--out", str(tmp_path / "runs"),
                          "--device", "cpu", "--no-plots", "--set", "axes.num_tokens=[64]", "--set",
                          "axes.padding_ratio=[0.5]", "--set", "timing.iters=1", "--set", "timing.warmup=0"],
                         capture_output=True, text=True, timeout=240, env=_env(), cwd=work)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "# points: ok 4" in run.stdout
    assert list(work.iterdir()) == []  # nothing lands in the current directory with --out


def test_default_run_location_is_ignored_by_git():
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "rev-parse"], capture_output=True,
                                                      timeout=30).returncode != 0:
        pytest.skip("not a git checkout")
    from moebench.run.results import DEFAULT_RUNS_DIR

    probe = DEFAULT_RUNS_DIR / "quickstart-20260101T000000Z" / "records.jsonl"
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(probe)], timeout=30)
    assert proc.returncode == 0, f"{probe} is not ignored by git"
    reference = REPO / "results" / "h200"
    runs = [p.parent for p in reference.glob("*/records.jsonl")]
    assert runs, "no committed reference run"
    for run in runs:  # records only: moebench plot RUN_DIR draws them
        assert (run / "manifest.json").exists() and (run / "summary.csv").exists(), run
    lock = reference / runs[0].name / "run.lock"
    assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(lock)], timeout=30).returncode == 0
