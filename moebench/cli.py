"""`moebench` command line: run, tune, plot, compare, list, report, profile, capture-search.

Exit codes: 0 every point ok (or skipped); 1 some point wrong or failed; 2 refused (bad sweep or arguments: one
line on stderr naming the file or option, the key and the reason; nothing written); 130 interrupted (SIGINT),
143 terminated (SIGTERM), both naming the run directory to `--resume` whatever phase of the run the signal lands
in (a point, the summary, the plots, a second signal during the clean-up, the moments after the run returned). A
SIGINT that was ignored when the process started (a background job of a script) stays ignored, as POSIX shells
expect; SIGTERM still stops the run.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from moebench import __version__
from moebench.run.capture_search import add_arguments as capture_search_arguments
from moebench.run.paths import bundled_sweeps, check_output_dir, sweep_argument_path
from moebench.run.results import DEFAULT_RUNS_DIR
from moebench.run.sweep import DEFAULT_MAX_POINTS, SweepError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own convention too)
        sys.stderr.write(f"moebench: error: {message}\n")
        raise SystemExit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the same clean-up as for Ctrl-C runs (ranks stopped, lock
    released, summary written)."""


class _Signals:
    """SIGINT and SIGTERM while `main` runs a command (main thread only). Until `settle`, each raises
    KeyboardInterrupt (Terminated) where it lands, so that a run cleans up; after it (the run has returned, or
    main is already reporting an interrupt) a signal is only noted, and main still exits 130 (143) naming the
    run."""

    def __init__(self):
        self.noted: int | None = None
        self.run_dir: Path | None = None
        self._settled = False
        self._previous: dict = {}

    def install(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored by whoever started us: kept so
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def settle(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir or self.run_dir
        self._settled = True

    def _on_signal(self, signum, frame):
        if self._settled:
            self.noted = self.noted or signum
            return
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _run_dir_of(e: BaseException) -> Path | None:
    """The run directory an interrupt carries (run_sweep sets it), also when a second signal interrupted the
    clean-up of the first: that one is the first's context."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "run_dir", None) is not None:
            return e.run_dir
        e = e.__cause__ or e.__context__
    return None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _load_for_run(args):
    """The sweep to run: SWEEP with --set, or with --resume the run's stored one (SWEEP, if given, must match)."""
    from moebench.run.resume import check_same_sweep, stored_sweep
    from moebench.run.sweep import load_sweep

    given = None
    if args.sweep is not None:
        given = load_sweep(sweep_argument_path(args.sweep), args.set or [], max_points=args.max_points,
                           size=args.size)
    elif not args.resume:
        raise SweepError("run: give a SWEEP file or bundled sweep name (see `moebench list`), or --resume RUN_DIR")
    elif args.set or args.size:
        what = f"--set {args.set[0]}" if args.set else f"--size {args.size}"
        raise SweepError(f"{what}: with --resume and no SWEEP the stored sweep runs unchanged")
    if not args.resume:
        return given
    stored = stored_sweep(args.resume)
    check_same_sweep(args.resume, stored, given)
    return stored


def _preset_notices(sweep, size: str | None = None) -> None:
    """A notice (stderr) for each model preset whose values explicit keys override, and for `--size cpu` of a sweep
    that declares no sizes (it runs as written)."""
    from moebench.presets import override_notices
    from moebench.run.sweep import CPU_SIZE

    notes = list(override_notices(sweep.fixed, sweep.axes))
    if size == CPU_SIZE and not sweep.sizes:
        notes.append(f"--size {CPU_SIZE}: {sweep.name} declares no sizes, it runs as written (already CPU-sized)")
    for line in notes:
        sys.stderr.write(f"moebench: note: {line}\n")


def cmd_run(args) -> int:
    from moebench.run.runner import dry_run, pick_device, run_sweep

    sweep = _load_for_run(args)
    _preset_notices(sweep, args.size)
    pick_device(args.device)  # what a run checks before its first point, a dry run checks too
    if not args.resume:
        check_output_dir("--out", args.out)
    if args.plots is not None and not args.no_plots:
        check_output_dir("--plots", args.plots)
    if args.dry_run:
        return dry_run(sweep, device=args.device)
    signals = getattr(args, "signals", None)

    def end_notes(run_dir: Path) -> list[str]:  # a capture-search point's answer too, fresh or resumed
        if args.no_plots:
            return _capture_search_notes(run_dir, None)
        return _plot_notes(run_dir, args.plots) + _capture_search_notes(run_dir, _plot_dir(run_dir, args.plots))

    try:
        code, run_dir = run_sweep(sweep, out_base=args.out, device=args.device, resume=args.resume,
                                  end_notes=end_notes, isolate=not args.in_process)
    except KeyboardInterrupt as e:
        if _run_dir_of(e) is None and args.resume:
            e.run_dir = Path(args.resume)
        raise
    if signals is not None:
        signals.settle(run_dir)  # a signal from here on is noted: main exits 130 or 143 naming this run
    return code


def _plot_notes(run_dir: Path, plots_base: str | None) -> list[str]:
    """The plots of a finished run, in `<run dir>/plots/` (`--plots DIR`: DIR/<run name>/), and the line saying
    so; a figure that fails leaves the run as it is and says why."""
    from moebench.run.point import error_line

    plot_dir = _plot_dir(run_dir, plots_base)
    try:
        from moebench.plots import make_plots  # matplotlib missing is said the same way

        paths = make_plots(run_dir, plot_dir)
    except Exception as e:
        return [f"plots not made: {error_line(e)}"]
    return [f"plots: {len(paths)} written to {plot_dir}"]


def _plot_dir(run_dir: Path, plots_base: str | None) -> Path:
    return Path(plots_base) / run_dir.name if plots_base is not None else run_dir / "plots"


def cmd_tune(args) -> int:
    from moebench.run.runner import pick_device
    from moebench.run.sweep import load_sweep
    from moebench.run.tune import run_tune, tune_sweeps

    sweep = load_sweep(sweep_argument_path(args.sweep), args.set or [], max_points=args.max_points, size=args.size)
    _preset_notices(sweep, args.size)
    tune_sweeps(sweep)  # refused here (one line) before anything runs: no tunable impl, a bad config name
    device = pick_device(args.device)
    if device.type == "cpu" and args.out is None:
        # the interpreter's timings say nothing of a GPU, and a cpu.json in the package would change every later
        # run's tuned_tables digest (and so refuse their resumes): only into a folder named for it
        raise SweepError("tune --device cpu: the package ships GPU tables only; give --out DIR for a CPU table")
    if args.out is not None:
        check_output_dir("--out", args.out)
    check_output_dir("--runs", args.runs)
    return run_tune(sweep, tables_dir=args.out, runs_dir=args.runs, device=args.device,
                    isolate=not args.in_process)


def cmd_plot(args) -> int:
    from moebench.plots import make_plots

    run_dir = Path(args.run_dir)
    if not (run_dir / "records.jsonl").exists():
        raise SweepError(f"{run_dir}: not a run directory (no records.jsonl)")
    if args.out:
        check_output_dir("--out", args.out)
    out = Path(args.out) / run_dir.name if args.out else run_dir / "plots"
    paths = make_plots(run_dir, out)
    for p in paths:
        print(p)
    return 0


def cmd_compare(args) -> int:
    from moebench.report.compare import compare_runs, max_cv_arg

    max_cv = max_cv_arg(args.max_cv)
    if args.run_b is None or args.impls:  # within one run (moebench.report.peers)
        if args.run_b is not None:
            raise SweepError("compare --impls compares impls within one run: give one run directory")
        from moebench.report.peers import compare_within_run

        return compare_within_run(Path(args.run_a), args.impls)
    return compare_runs(Path(args.run_a), Path(args.run_b), max_cv=max_cv)


def cmd_list(args) -> int:
    from moebench import registry

    if getattr(args, "configs", False):  # the launch configs a sweep's `config` can name (kernels._details.tuning)
        from moebench.kernels.runtime import tuning

        for kernel in tuning.tunable_kernels():
            t = tuning.tunable(kernel)
            print(f"# {kernel}: rule {t.rule_doc}")
            print("  " + " ".join(t.candidates))
        return 0
    if getattr(args, "models", False):  # the model presets a sweep can name with `model:` (moebench.presets)
        from moebench.presets import describe

        print(f"# {'model':<18} {'shape':<64} source")
        for name, shape, source in describe():
            print(f"  {name:<18} {shape:<64} {source}")
        return 0
    impls = registry.all_impls()
    print("# targets: " + ", ".join(registry.TARGETS))
    print(f"# {'impl':<40} {'targets':<22} {'available here':<16} description")
    import torch

    from moebench.registry import RunContext

    ctx = RunContext(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    for name, impl in impls.items():
        try:
            why = impl.available(ctx)
        except Exception as e:
            why = str(e)
        avail = "yes" if not why else "no"
        print(f"  {name:<40} {','.join(impl.targets):<22} {avail:<16} {impl.description}"
              + (f" [{why}]" if why else ""))
    print("# bundled sweeps:")
    for p in bundled_sweeps():
        print(f"  {p.stem:<24} {p}")
    return 0


def cmd_profile(args) -> int:
    from moebench.profile import profile_inner, profile_point
    from moebench.run.results import utc_stamp
    from moebench.run.runner import check_point_index, pick_device
    from moebench.run.sweep import load_sweep, size_overrides

    path = sweep_argument_path(args.sweep)
    if args.size is not None:  # handed on as overrides: the process nsys runs gets the same sweep
        args.set = size_overrides(path, args.size) + (args.set or [])
    sweep = load_sweep(path, args.set or [])  # validate first: one clear line on bad input
    _preset_notices(sweep)
    check_point_index(sweep, args.point)  # and the arguments, before anything is created
    pick_device(args.device)
    if not args.inner:
        check_output_dir("--out", args.out)
    if args.inner:  # the process nsys launches
        rec = profile_inner(path, args.point, args.set or [], args.device or "cuda", args.iters)
        return 0 if not isinstance(rec, dict) or rec.get("status") == "ok" else 1
    out_dir = Path(args.out) / f"profile-{sweep.name}-p{args.point}-{utc_stamp()}"
    result = profile_point(path, args.point, out_dir, args.set or [], args.device, iters=args.iters)
    print(f"# profile written to {out_dir}")
    return 0 if not result.get("error") else 1


def cmd_report(args) -> int:
    from moebench.report.page import write_report

    print(write_report(args.run_dirs, args.out, title=args.title))
    return 0


def _capture_search_notes(run_dir: Path, plot_dir: Path | None) -> list[str]:
    """The answer of each capture-search point of a finished run, under its table: the operator's table, the
    headline and its plot (drawn by make_plots, one of the run's figures, into plot_dir; None: no plots). Every
    command that finishes a run prints it: `moebench capture-search`, `moebench run`, a resumed run of either."""
    from moebench.records import load_records, unique_records
    from moebench.report.capture_search import footer_lines, search_records

    found = search_records(unique_records(load_records(run_dir)))
    drawn = sorted(plot_dir.glob("capture_search*.png")) if plot_dir is not None and found else []
    return footer_lines(found) + [f"plot: {path}" for path in drawn]


def cmd_capture_search(args) -> int:
    """Run the search's one point; its table, headline and plot are printed under the run's table (exit: the
    run's, or 1 when no answer was recorded)."""
    from moebench.report.capture_search import search_records
    from moebench.run.capture_search import capture_search_sweep
    from moebench.run.results import load_records
    from moebench.run.runner import pick_device, run_sweep
    from moebench.run.sweep import sweep_from_dict

    sweep = sweep_from_dict(capture_search_sweep(args), "capture-search")  # refused here: one line, nothing written
    _preset_notices(sweep)
    pick_device(args.device)
    check_output_dir("--out", args.out)
    code, run_dir = run_sweep(sweep, out_base=args.out, device=args.device, isolate=not args.in_process,
                              end_notes=lambda d: _plot_notes(d, None) + _capture_search_notes(d, d / "plots"))
    return code if search_records(load_records(run_dir)) else (code or 1)


_SIZE_HELP = ("apply the sweep's size NAME (its `sizes:` block; the bundled GPU-scale sweeps and scenarios declare "
              "`cpu`), before any --set")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="moebench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"moebench {__version__}")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)

    r = sub.add_parser("run", help="expand a sweep, check and time every point")
    r.add_argument("sweep", nargs="?", help="sweep YAML file, or the name of a bundled sweep (see `moebench list`);"
                                            " with --resume it may be left out")
    r.add_argument("--out", default=str(DEFAULT_RUNS_DIR),
                   help=f"base directory of run directories (default: {DEFAULT_RUNS_DIR}); plots go inside each run")
    r.add_argument("--plots", default=None, metavar="DIR",
                   help="put the plots in DIR/<run name>/ instead of <run dir>/plots/")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a sweep key with a YAML value, e.g. axes.top_k=[4,8] or top_k=6")
    r.add_argument("--size", default=None, metavar="NAME", help=_SIZE_HELP)
    r.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    r.add_argument("--resume", metavar="RUN_DIR",
                   help="continue an interrupted run with its stored sweep, skipping recorded points")
    r.add_argument("--max-points", type=_positive_int, default=DEFAULT_MAX_POINTS,
                   help=f"refuse sweeps of more points (default: {DEFAULT_MAX_POINTS:,})")
    r.add_argument("--dry-run", action="store_true", help="list the points and exit")
    r.add_argument("--no-plots", action="store_true", help="do not make plots at the end")
    r.add_argument("--in-process", action="store_true",
                   help="run single-rank points in this process, not in the point worker (for a debugger: a point "
                        "that crashes or hangs then ends the run)")
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("tune", help="time every launch candidate of the sweep's tuned kernels, write the tuned "
                                    "tables the kernels use by default")
    t.add_argument("sweep", help="sweep YAML file, or the name of a bundled sweep (e.g. tune_moe_sum)")
    t.add_argument("--out", default=None, metavar="DIR",
                   help="write the tables (<GPU name>.json) to DIR instead of the package's moebench/kernels/tuned/")
    t.add_argument("--runs", default=str(DEFAULT_RUNS_DIR), metavar="DIR",
                   help=f"base directory of the tuning runs (default: {DEFAULT_RUNS_DIR})")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a sweep key, as for run")
    t.add_argument("--size", default=None, metavar="NAME", help=_SIZE_HELP)
    t.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    t.add_argument("--max-points", type=_positive_int, default=DEFAULT_MAX_POINTS,
                   help=f"refuse sweeps of more points (default: {DEFAULT_MAX_POINTS:,})")
    t.add_argument("--in-process", action="store_true", help="run the points in this process (see run)")
    t.set_defaults(func=cmd_tune)

    p = sub.add_parser("plot", help="make the plots of a run directory")
    p.add_argument("run_dir", help="a run directory (holds records.jsonl)")
    p.add_argument("--out", default=None, help="put the plots in OUT/<run name>/ (default: <run dir>/plots/)")
    p.set_defaults(func=cmd_plot)

    c = sub.add_parser("compare", help="ratios of p50 per matching point of two runs (B / A)")
    c.add_argument("run_a", help="a run directory: the baseline A (or the one run compared within)")
    c.add_argument("run_b", nargs="?", default=None,
                   help="omitted: compare within RUN_A (every impl vs the best peer, or --impls A,B)")
    c.add_argument("--impls", metavar="A,B", default=None, help="within one run: p50 ratio B/A per point")
    c.add_argument("--max-cv", metavar="PCT", default="10",
                   help="flag points whose cv is above PCT %% in either run and leave them out of the geometric "
                        "means (default 10)")
    c.set_defaults(func=cmd_compare)

    ls = sub.add_parser("list", help="kernels, implementations, dispatch paths and bundled sweeps")
    ls.add_argument("--models", action="store_true", help="list the model presets (`model:` under fixed)")
    ls.add_argument("--configs", action="store_true",
                    help="list each tuned kernel's launch configs (`config:`) and its rule")
    ls.set_defaults(func=cmd_list)

    rp = sub.add_parser("report", help="one self-contained HTML (or Markdown) page of runs: manifest, headline "
                                       "numbers, tables, plots")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or profile folders) to report")
    rp.add_argument("-o", "--out", required=True, help="FILE.html (images embedded) or FILE.md (images linked)")
    rp.add_argument("--title", default="moebench report", help="the page's title (default: %(default)s)")
    rp.set_defaults(func=cmd_report)

    cs = sub.add_parser("capture-search", help="the cheapest CUDA-graph capture list of at most K sizes for a trace, "
                                               "masked and oblivious (serving_trace.capture_search)")
    capture_search_arguments(cs, _positive_int, str(DEFAULT_RUNS_DIR))
    cs.set_defaults(func=cmd_capture_search)

    pr = sub.add_parser("profile", help="profile one point under nsys (or torch.profiler)")
    pr.add_argument("sweep", help="sweep YAML file, or the name of a bundled sweep (see `moebench list`)")
    pr.add_argument("--point", type=int, required=True, help="point index (see `moebench run --dry-run`)")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a sweep key, as for run")
    pr.add_argument("--size", default=None, metavar="NAME", help=_SIZE_HELP)
    pr.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    pr.add_argument("--out", default=str(DEFAULT_RUNS_DIR), help="base directory for the profile output "
                                                                 f"(default: {DEFAULT_RUNS_DIR})")
    pr.add_argument("--iters", type=int, default=20, help="profiled iterations (eager launches with stage ranges) inside the capture range, after the point's usual timing")
    pr.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the process nsys launches
    pr.set_defaults(func=cmd_profile)
    return ap


def _interpret_without_gpu(args) -> None:
    """With no GPU (or --device cpu) the Triton kernels run in Triton's interpreter; the switch must be set
    before triton is first imported, i.e. before any kernel module loads."""
    import os

    if os.environ.get("TRITON_INTERPRET"):
        return
    if getattr(args, "device", None) == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _interrupted(signum: int, run_dir: Path | None) -> int:
    what = "terminated" if signum == signal.SIGTERM else "interrupted"
    hint = f"; resume with: moebench run --resume {run_dir}" if run_dir else ""
    sys.stderr.write(f"moebench: {what}{hint}\n")
    return 143 if signum == signal.SIGTERM else 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:  # a usage error like any other: the usage on stderr, exit 2
        parser.print_help(sys.stderr)
        return 2
    _interpret_without_gpu(args)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only there can it take signals
    args.signals = signals = _Signals().install() if in_main_thread else None
    try:
        code = int(args.func(args) or 0)
        if signals is not None and signals.noted:  # landed after the run returned
            return _interrupted(signals.noted, signals.run_dir)
        return code
    except (SweepError, ValueError) as e:
        sys.stderr.write(f"moebench: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}\n")
        return 2
    except BrokenPipeError:  # `moebench run ... | head`: stop quietly, as other command-line tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a file that vanished, a full disk: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"moebench: error: {where}{e.strerror or e}\n")
        return 2
    except KeyboardInterrupt as e:
        if signals is not None:
            signals.settle()  # a further signal while this is reported is only noted
        return _interrupted(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT, _run_dir_of(e))
    finally:
        if signals is not None:
            signals.restore()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
