"""`--size cpu`, which the README tells CPU users to add, is taken by every bundled sweep: a sweep that declares no
sizes runs as written (it says so), any other missing size is still refused naming the sizes the file has."""

import pytest

from moebench.cli import main
from moebench.run.paths import bundled_sweeps
from moebench.run.sweep import SweepError, load_sweep, size_overrides


def test_every_bundled_sweep_takes_size_cpu():
    for path in bundled_sweeps():
        load_sweep(path, size="cpu")  # raises SweepError on a refusal


def test_quickstart_dry_run_with_size_cpu_notes_it_runs_as_written(tmp_path, capsys):
    assert main(["run", "quickstart", "--size", "cpu", "--dry-run", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "--size cpu: quickstart declares no sizes, it runs as written" in err
    assert not any(tmp_path.iterdir())


def test_a_size_a_file_does_not_declare_is_still_refused(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\ntarget: router\nimpls: [topk_softmax.torch]\naxes: {num_tokens: [8]}\n")
    assert size_overrides(sweep, "cpu") == []
    with pytest.raises(SweepError, match=r"--size gpu: .* has no size 'gpu' \(sizes: it declares none\)"):
        load_sweep(sweep, size="gpu")
    sweep.write_text(sweep.read_text() + "sizes: {small: {axes.num_tokens: [4]}}\n")
    with pytest.raises(SweepError, match=r"--size cpu: .* has no size 'cpu' \(sizes: small\)"):
        load_sweep(sweep, size="cpu")
