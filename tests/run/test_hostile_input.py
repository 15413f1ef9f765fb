"""Hostile and malformed input at the command line: each is refused with exit 2 and one line naming the file (or
option), the key and the reason, quickly, with no traceback and nothing written anywhere."""

import io
import os
import subprocess
import sys
import time

import pytest

from moebench.cli import main
from moebench.run.sweep import DEFAULT_MAX_POINTS, load_sweep

GOOD = """\
name: t
target: router
impls: [topk_softmax.torch]
fixed: {num_experts: 16, top_k: 2}
axes:
  num_tokens: [8, 16]
  padding_ratio: [0.0, 0.5]
timing: {warmup: 0, iters: 2}
"""

BILLION = GOOD.replace("""axes:
  num_tokens: [8, 16]
  padding_ratio: [0.0, 0.5]
""", "axes:\n" + "".join(f"  {k}: [{', '.join(str(i) for i in range(1, 11))}]\n" for k in (
    "num_tokens", "seed", "repeat", "hidden", "intermediate", "block_size", "group_size", "trace_steps",
    "producer_size")))


def _alias_bomb() -> str:
    lines = ["a0: &a0 [lol]"]
    for level in range(1, 10):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 9)}]")
    return GOOD + "\n".join(lines) + "\n"


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in files + dirs)


def _write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _refused(tmp_path, capsys, monkeypatch, args, *expected, limit_s=20.0):
    """Run the CLI in this process from tmp_path; assert exit 2, one line holding `expected`, nothing written."""
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    t0 = time.monotonic()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moebench: error: "), err
    assert "Traceback" not in err and out == ""
    for e in expected:
        assert e in lines[0], lines[0]
    assert _tree(tmp_path) == before, "something was written"
    assert took < limit_s, f"refusal took {took:.1f} s"
    return lines[0]


def _run_args(path, tmp_path, *extra):
    return ["run", path, "--out", tmp_path / "out", "--device", "cpu", *extra]


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_a_billion_points_refused_before_expansion(tmp_path, capsys, monkeypatch, dry):
    path = _write(tmp_path, BILLION)
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path, *(["--dry-run"] if dry else [])),
             str(path), "axes:", "1,000,000,000 points", f"limit of {DEFAULT_MAX_POINTS:,}", "--max-points")


def test_max_points_raises_and_lowers_the_limit(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)  # 4 points
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path, "--max-points", "3", "--dry-run"),
             "4 points, over the limit of 3")
    assert main(["run", str(path), "--max-points", "4", "--dry-run"]) == 0
    assert len(load_sweep(_write(tmp_path, BILLION, "b.yaml"), ["axes.seed=[1]", "axes.repeat=[1]",
                                                                 "axes.hidden=[1]", "axes.intermediate=[1]",
                                                                 "axes.block_size=[1]"],
                          max_points=10_000).axes["num_tokens"]) == 10
    capsys.readouterr()
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path, "--max-points", "0"), "--max-points",
             "must be >= 1")


def test_yaml_alias_bomb_refused_before_composition(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, _alias_bomb())
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), "line 10",
             "YAML aliases (*a0) are not allowed", limit_s=5.0)
    _refused(tmp_path, capsys, monkeypatch, _run_args(_write(tmp_path, GOOD, "g.yaml"), tmp_path, "--set",
                                                      "description=[&x 1, *x]"),
             "--set description=[&x 1, *x]", "aliases")


def test_duplicate_keys_refused_naming_the_key(tmp_path, capsys, monkeypatch):
    text = GOOD.replace("  padding_ratio: [0.0, 0.5]\n", "  padding_ratio: [0.0, 0.5]\n  num_tokens: [32]\n")
    path = _write(tmp_path, text)
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), "line 8",
             "duplicate key 'num_tokens' (first at line 6)")
    path = _write(tmp_path, GOOD + "name: again\n", "top.yaml")
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), "duplicate key 'name'")


@pytest.mark.parametrize("edit,where", [
    (("fixed: {num_experts: 16, top_k: 2}", "fixed: {num_experts: 16, top_k: 2, zipf_exponent: .nan}"),
     "fixed.zipf_exponent: nan"),
    (("fixed: {num_experts: 16, top_k: 2}", "fixed: {num_experts: 16, top_k: 2, routed_scaling_factor: .inf}"),
     "fixed.routed_scaling_factor: inf"),
    (("timing: {warmup: 0, iters: 2}", "timing: {warmup: 0, iters: 2, max_seconds: .nan}"),
     "timing.max_seconds: nan"),
    (("padding_ratio: [0.0, 0.5]", "padding_ratio: [0.0, -.inf]"), "axes.padding_ratio[1]: -inf"),
], ids=["zipf_nan", "scaling_inf", "max_seconds_nan", "axis_minus_inf"])
def test_nan_and_inf_refused_for_every_float(tmp_path, capsys, monkeypatch, edit, where):
    path = _write(tmp_path, GOOD.replace(*edit))
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), where, "must be finite")


def test_nan_through_set_refused(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path, "--set", "fixed.hot_ratio=.nan"),
             "fixed.hot_ratio: nan")


@pytest.mark.parametrize("name,shown", [('"two\\nlines"', "'two\\nlines'"), ("x" * 300, "(300 characters)"),
                                        ("../up", "'../up'"), ('".hidden"', "'.hidden'")],
                         ids=["newline", "300_chars", "slash", "dot"])
def test_unsafe_names_refused(tmp_path, capsys, monkeypatch, name, shown):
    path = _write(tmp_path, GOOD.replace("name: t", f"name: {name}"))
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), "name:", shown,
             "1-64 letters, digits")


def test_deep_nesting_refused_without_recursion_error(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD.replace("num_tokens: [8, 16]", "num_tokens: " + "[" * 5000 + "]" * 5000))
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), "line 6",
             "nested deeper than 32 levels")
    deep = "[" * 100 + "1" + "]" * 100
    _refused(tmp_path, capsys, monkeypatch, _run_args(_write(tmp_path, GOOD, "g.yaml"), tmp_path, "--set",
                                                      f"fixed.trace={deep}"), "--set", "nested deeper")


def test_unreadable_files_named(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD.encode().replace(b"name: t", b"name: t\xff"))
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path), str(path), "line 1",
             "not UTF-8 text (byte 0xff at offset 7)")
    _refused(tmp_path, capsys, monkeypatch, _run_args(tmp_path / "missing.yaml", tmp_path),
             "missing.yaml: cannot read (No such file or directory)")
    (tmp_path / "adir").mkdir()
    _refused(tmp_path, capsys, monkeypatch, _run_args(tmp_path / "adir", tmp_path),
             "adir: cannot read (is a directory)")
    os.mkfifo(tmp_path / "fifo")  # would block a plain read forever
    _refused(tmp_path, capsys, monkeypatch, _run_args(tmp_path / "fifo", tmp_path), "fifo: cannot read (not a regular")
    big = _write(tmp_path, GOOD + "#" * (1 << 20), "big.yaml")
    _refused(tmp_path, capsys, monkeypatch, _run_args(big, tmp_path), "big.yaml: larger than 1 MiB")
    _refused(tmp_path, capsys, monkeypatch, _run_args("/dev/zero", tmp_path), "/dev/zero: cannot read (not a regular")


def test_out_that_cannot_hold_runs_refused(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)
    afile = _write(tmp_path, "x", "afile")
    _refused(tmp_path, capsys, monkeypatch, ["run", path, "--out", afile, "--device", "cpu"],
             f"--out {afile}: not a directory")
    _refused(tmp_path, capsys, monkeypatch, ["run", path, "--out", afile / "sub" / "dir", "--device", "cpu"],
             f"--out {afile / 'sub' / 'dir'}: {afile} is a file")
    if os.geteuid() == 0:  # root writes through file modes: a pseudo filesystem refuses creation instead
        readonly = "/proc/moebench-out"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        readonly = tmp_path / "ro" / "runs"
    _refused(tmp_path, capsys, monkeypatch, ["run", path, "--out", readonly, "--device", "cpu"],
             f"--out {readonly}:")


def test_plots_that_is_a_file_refused_before_running(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)
    afile = _write(tmp_path, "x", "afile")
    _refused(tmp_path, capsys, monkeypatch, _run_args(path, tmp_path, "--plots", afile),
             f"--plots {afile}: not a directory")


def test_profile_bad_point_creates_nothing(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)
    _refused(tmp_path, capsys, monkeypatch, ["profile", path, "--point", "99", "--out", tmp_path / "prof",
                                             "--device", "cpu"], "--point 99: the sweep has points 0..3")
    afile = _write(tmp_path, "x", "afile")
    _refused(tmp_path, capsys, monkeypatch, ["profile", path, "--point", "0", "--out", afile / "x",
                                             "--device", "cpu"], f"--out {afile / 'x'}: {afile} is a file")


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "--device: 'tpu' is not cuda, cuda:N or cpu"),
    (["--device", "cuda:x"], "--device: 'cuda:x' is not cuda, cuda:N or cpu"),
    (["--set", "axes.top_k"], "--set axes.top_k: expected key=value"),
    (["--set", "axes.top_k=[1, 2"], "--set axes.top_k=[1, 2: value is not valid YAML"),
    (["--resume", "nowhere"], "--resume nowhere: not a directory"),
    (["--set", "timing.iters=-3"], "timing.iters: -3 is not >= 1 (from --set timing.iters=-3)"),
    (["--set", "trace_file="], "--set trace_file=: no value for trace_file"),  # not the synthetic trace, silently
], ids=["device", "device_index", "set_no_value", "set_bad_yaml", "resume_missing", "set_negative_iters",
        "set_empty_value"])
def test_bad_options_refused(tmp_path, capsys, monkeypatch, args, message):
    path = _write(tmp_path, GOOD)
    _refused(tmp_path, capsys, monkeypatch, ["run", path, "--out", tmp_path / "out", *args], message)


def test_resume_of_something_that_is_no_run(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, GOOD)
    (tmp_path / "empty").mkdir()
    _refused(tmp_path, capsys, monkeypatch, ["run", path, "--resume", tmp_path / "empty"],
             f"--resume {tmp_path / 'empty'}: no manifest.json there")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "manifest.json").write_text('{"sweep": ')
    _refused(tmp_path, capsys, monkeypatch, ["run", "--resume", tmp_path / "torn"], "manifest.json is unreadable")
    _refused(tmp_path, capsys, monkeypatch, ["run"], "give a SWEEP file or bundled sweep name")


def test_cuda_graph_on_a_cpu_says_what_was_used(tmp_path):
    from moebench.run.results import load_manifest, load_records
    from moebench.run.runner import run_sweep

    path = _write(tmp_path, GOOD.replace("timing: {warmup: 0, iters: 2}",
                                         "timing: {mode: cuda_graph, warmup: 0, iters: 2}"))
    out = io.StringIO()
    code, run_dir = run_sweep(load_sweep(path, ["axes.padding_ratio=[0.0]", "axes.num_tokens=[8]"]),
                              out_base=tmp_path / "runs", device="cpu", out=out)
    assert code == 0
    text = out.getvalue()
    assert "timing: cuda_graph needs CUDA, wall clock on the CPU" in text
    assert "Triton kernels in the interpreter (mode column: interp)" in text  # conftest sets TRITON_INTERPRET
    header = next(line for line in text.splitlines() if " impl " in line)
    row = next(line for line in text.splitlines() if "topk_softmax.torch" in line)
    # a torch row launches no Triton kernel: its mode is the wall clock it was timed with, not `interp`
    assert header.split()[-2:] == ["mode", "status"] and row.split()[-2:] == ["wall", "ok"]
    (rec,) = load_records(run_dir)
    assert rec["timing_mode"] == "wall" and rec["triton_interpret"] is True and "needs CUDA" in rec["timing_note"]
    assert rec["interpreted_launches"] == 0
    summary = (run_dir / "summary.csv").read_text().splitlines()
    assert dict(zip(summary[0].split(","), summary[1].split(",")))["mode"] == "wall"
    env = load_manifest(run_dir)["env"]  # what a CPU figure was measured on
    assert env["cpu_count"] == os.cpu_count() and env["os"] and env["triton_interpret"] == "1" and "cpu" in env


def test_version_and_bare_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    from moebench import __version__

    assert capsys.readouterr().out.strip() == f"moebench {__version__}"
    assert main([]) == 2  # a usage error: the usage on stderr
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: moebench") and "run" in err and "Exit codes" in err


def test_refusal_in_a_fresh_process_is_one_line_and_fast(tmp_path):
    """The alias bomb's refusal from the real entry point: no traceback, within a minute (the time is what
    is asserted: an expanded bomb would not finish; the billion-point sweep's refusal is the same path, in process,
    above)."""
    path = _write(tmp_path, _alias_bomb())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moebench", "run", str(path), "--out", str(tmp_path / "o"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and str(path) in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o").exists()


def test_dry_run_of_bundled_sweeps_still_validates():
    """The strict loader accepts every bundled sweep (no aliases, no duplicate keys in them)."""
    from moebench.run.paths import bundled_sweeps

    sweeps = bundled_sweeps()
    assert any(p.stem == "quickstart" for p in sweeps)
    for p in sweeps:
        load_sweep(p)
