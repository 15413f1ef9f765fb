"""The cost estimate before a run (and in --dry-run), the warning past 30 minutes, and the sweeps' `--size cpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moebench.cli import main
from moebench.run.estimate import WARN_AFTER_S, estimate_run
from moebench.run.paths import bundled_sweeps
from moebench.run.sweep import SweepError, expand, load_sweep

CPU = torch.device("cpu")


def test_a_gpu_scale_sweep_on_a_cpu_warns_and_its_cpu_size_does_not(capsys):
    assert main(["run", "layer", "--device", "cpu", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "# estimate: ~" in out and "points would reach the point timeout" in out
    (warning,) = err.splitlines()
    assert warning.startswith("moebench: warning: this run is estimated at ~") and "--size cpu" in warning
    assert "# warning: this run is estimated" in out  # a kept (non-terminal) table says so too
    assert main(["run", "layer", "--device", "cpu", "--dry-run", "--size", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "# estimate: ~" in out and err == ""


def test_every_bundled_sweep_over_30_minutes_on_a_cpu_declares_a_cpu_size_under_it():
    for path in bundled_sweeps():
        sweep = load_sweep(path)
        if "cpu" not in sweep.sizes:
            assert estimate_run(expand(sweep), sweep.timing, CPU).total_s < WARN_AFTER_S, path.stem
            continue
        small = load_sweep(path, size="cpu")
        assert estimate_run(expand(small), small.timing, CPU).total_s < WARN_AFTER_S / 3, path.stem


def test_scenarios_declare_a_cpu_size():
    scenarios = [p for p in bundled_sweeps() if p.parent.name == "scenarios"]
    assert scenarios and all("cpu" in load_sweep(p).sizes for p in scenarios)


def test_a_size_applies_before_set_and_bad_sizes_are_one_line(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntarget: router\nimpls: [topk_softmax.torch]\nfixed: {num_experts: 64, top_k: 4}\n"
                    "axes: {num_tokens: [64, 512]}\nsizes:\n  cpu: {num_experts: 16, axes.num_tokens: [8], "
                    "timing.iters: 2}\n")
    sweep = load_sweep(path, ["top_k=2"], size="cpu")
    (pt,) = expand(sweep)
    assert (pt.params.num_experts, pt.params.top_k, pt.params.num_tokens, sweep.timing.iters) == (16, 2, 8, 2)
    assert [p.params.num_tokens for p in expand(load_sweep(path))] == [64, 512]  # no size: the file's own
    with pytest.raises(SweepError, match=r"--size gpu: .* has no size 'gpu' \(sizes: cpu\)"):
        load_sweep(path, size="gpu")
    path.write_text(path.read_text().replace("num_experts: 16", "num_experts: 3"))
    with pytest.raises(SweepError, match=r"top_k: 4 > num_experts 3.*\(with sizes.cpu\)"):
        load_sweep(path)  # a size is validated with the file, whether or not it is asked for
    path.write_text(path.read_text().replace("cpu: {num_experts: 3", "cpu: {sizes.x: 1, num_experts: 3"))
    assert main(["run", str(path), "--dry-run", "--size", "cpu", "--device", "cpu"]) == 2
    assert "sizes.cpu: 'sizes.x' is not an override key" in capsys.readouterr().err


def test_profile_hands_a_size_on_as_overrides():
    from moebench.run.sweep import size_overrides

    layer = Path(next(p for p in bundled_sweeps() if p.stem == "layer"))
    sets = size_overrides(layer, "cpu")
    assert "axes.num_tokens=[32]" in sets and "timing.iters=3" in sets
    assert load_sweep(layer, sets).to_dict() == load_sweep(layer, size="cpu").to_dict()


def test_every_registered_impl_has_declared_work_and_estimate_knows_no_family():
    """Each family (or impl) declares its work beside its impls; the estimate holds no table of family names."""
    from moebench import registry
    from moebench.run import estimate

    bundled = {name: impl for name, impl in registry.all_impls().items()
               if impl.build.__module__.startswith("moebench.")}  # not the impls tests register at run time
    assert not [name for name, impl in bundled.items() if registry.work_of(impl) is None]
    source = Path(estimate.__file__).read_text()
    families = {impl.kernel for impl in registry.all_impls().values()} - {"serving_trace"}
    assert not [f for f in families if f'"{f}"' in source]


def test_a_family_without_declared_work_is_named_above_the_table(tmp_path, capsys):
    from moebench import registry

    if "undeclared_family.x" not in registry.all_impls():
        registry.register(registry.Impl("undeclared_family.x", targets=("kernel",), build=lambda p, ctx: None))
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntarget: kernel\nimpls: [undeclared_family.x]\naxes: {num_tokens: [8]}\n")
    assert main(["run", str(path), "--dry-run", "--device", "cpu"]) == 0
    assert "# estimate: undeclared_family declare no work per point (counted as one launch a call)" in \
        capsys.readouterr().out


def test_a_point_whose_impl_cannot_run_here_costs_nothing(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntarget: dispatch\nimpls: [dispatch.agrs, dispatch.deepep]\n"
                    "fixed: {num_tokens: 32, hidden: 64, num_experts: 16, top_k: 4, ep_size: 2}\n"
                    "timing: {warmup: 1, iters: 3}\n")
    sweep = load_sweep(path)
    agrs, deepep = expand(sweep)
    from moebench.run.estimate import COMMAND_START_S

    assert estimate_run([deepep], sweep.timing, CPU).total_s == COMMAND_START_S  # no deep_ep on a CPU: skipped at once
    assert estimate_run([agrs], sweep.timing, CPU).total_s > COMMAND_START_S + 2  # two ranks started, the point run


def test_the_warning_is_not_repeated_in_a_table_on_a_terminal(capsys):
    """On a terminal the table would print the warning beside stderr's line: only stderr says it there."""
    import io

    from moebench.report.table import Table
    from moebench.run.runner import _param_columns, _state_estimate

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    sweep = load_sweep(next(p for p in bundled_sweeps() if p.stem == "layer"))
    cost = estimate_run(expand(sweep), sweep.timing, CPU)
    out = Terminal()
    _state_estimate(Table(_param_columns(sweep), out=out, points=expand(sweep)), cost, sweep)
    assert "# estimate: ~" in out.getvalue() and "warning" not in out.getvalue()
    assert capsys.readouterr().err.startswith("moebench: warning: this run is estimated")


@pytest.mark.parametrize("top_k,hidden", [(8, 7168), (1, 7168), (2, 64)])
def test_masked_moe_sum_declares_the_grid_its_kernel_launches(top_k, hidden):
    """The interpreter's cost of masked_moe_sum.triton counts every program of the launched grid (row blocks x column
    blocks of the hidden size), each at the declared cost of a program with top_k slots. The launch is recorded, not
    run: only its grid is read."""
    from moebench import registry
    from moebench.measure.cost import SUM_PROGRAM, SUM_SLOT
    from moebench.measure.interpreted_launches import patched_interpreted_launches
    from moebench.params import Params

    grids = []

    def wrap(original):
        def run(self, *args, grid, warmup, **kwargs):
            grids.append(grid)
        return run

    impl = registry.get("masked_moe_sum.triton")
    p = Params(num_tokens=4, num_experts=16, top_k=top_k, hidden=hidden)
    case = impl.build(p, registry.RunContext(CPU))
    with patched_interpreted_launches(wrap) as patched:
        if not patched:
            pytest.skip("no interpreted Triton launch to record")
        case.run()
    ((rows, cols),) = grids
    assert registry.work_of(impl).programs(p) == rows * cols * (SUM_PROGRAM + SUM_SLOT * top_k)
