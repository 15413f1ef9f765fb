"""`moebench capture-search`: its arguments and its sweep, the one point of serving_trace.capture_search the options
describe. The command line runs it and prints the operator's table, plot and headline under the run's table (as
`moebench run` does for any run with a capture-search point, resumed or not).

`--size NAME` reads the bundled scenario's `sizes:` (sweeps/scenarios/capture_search.yaml), as `moebench run --size`
reads a sweep file's, and applies NAME's keys before --shape-timings and --set; the keys of the question the command
asks (the trace, the engine, the search: QUESTION_KEYS) stay TRACE's and the options', whatever the size."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from moebench.run.paths import bundled_sweep_dir
from moebench.run.sweep import SweepError, apply_overrides, size_overrides
from moebench.traces.knobs import TRACE_DISTRIBUTIONS

SCENARIO = Path("scenarios") / "capture_search.yaml"  # under the bundled sweeps: whose sizes --size reads
# Said by TRACE and the options: a size that set them would answer another question than the one asked (the
# scenario's explicit `trace` list would even replace TRACE, an explicit list beating a distribution).
QUESTION_KEYS = frozenset({"model", "trace", "trace_file", "trace_distribution", "trace_steps", "trace_max_tokens",
                           "dp_size", "sp_size", "dbo", "ep_size", "padding_fill", "seed", "trace_real_points",
                           "capture_graphs", "capture_largest", "capture_keep"})


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(cs: argparse.ArgumentParser, positive_int: Callable[[str], int], runs_dir: str) -> None:
    """The options of `moebench capture-search` on its subparser."""
    cs.add_argument("trace", help="a CSV trace (one column, or one per DP rank) or a distribution: "
                                  + ", ".join(TRACE_DISTRIBUTIONS))
    cs.add_argument("--model", required=True, help="a model preset (see `moebench list --models`)")
    cs.add_argument("--graphs", type=int_list, default=None, metavar="K,K,...",
                    help="the graph budgets K (default 1, 2, 4, ... up to the trace's candidate sizes)")
    cs.add_argument("--largest", type=int, default=None, help="fix the list's largest size (a candidate size)")
    cs.add_argument("--keep", type=int_list, default=None, metavar="N,N,...", help="sizes that must stay")
    cs.add_argument("--dp-size", type=positive_int, default=1, help="DP ranks, each padded to their max (default 1)")
    cs.add_argument("--sp-size", type=positive_int, default=1, help="SP (TP) ranks a micro-batch is padded for and "
                                                                  "chunked over (default 1)")
    cs.add_argument("--dbo", action="store_true", help="dual-batch overlap")
    cs.add_argument("--ep-size", type=positive_int, default=1, help="EP ranks; this rank holds num_experts / "
                                                                  "ep_size experts (default 1)")
    cs.add_argument("--fill", default="repeat", help="padding_fill (default repeat)")
    cs.add_argument("--steps", type=positive_int, default=1000, help="steps drawn from a distribution")
    cs.add_argument("--max-tokens", type=positive_int, default=512, help="a distribution's tokens a step at most")
    cs.add_argument("--shape-timings", type=positive_int, default=None,
                    help="shapes timed before the cost model reads the rest (trace_shape_timings)")
    cs.add_argument("--seed", type=int, default=0, help="the inputs' and a drawn trace's seed (default 0)")
    cs.add_argument("--size", default=None, metavar="NAME",
                    help="apply the capture_search scenario's size NAME (its `sizes:` block; `cpu`: shapes for "
                         "Triton's interpreter) to the layer, before --shape-timings and --set; the trace, the "
                         "engine and the budgets stay the options'")
    cs.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="any other sweep key of the point, e.g. hidden=64 (a YAML value), as for run")
    cs.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    cs.add_argument("--out", default=runs_dir, help=f"base directory of the run (default: {runs_dir})")
    cs.add_argument("--in-process", action="store_true", help="run the point in this process (see run)")


def _question(args) -> dict:
    """The point's fixed keys TRACE and the options say (QUESTION_KEYS, and the shapes timed when given)."""
    trace = args.trace
    fixed = {"model": args.model, "ep_size": args.ep_size, "dp_size": args.dp_size, "sp_size": args.sp_size,
             "dbo": args.dbo, "padding_fill": args.fill, "seed": args.seed, "trace_real_points": 0}
    if args.graphs is not None:  # else the sweep key's default: 1, 2, 4, ... up to the candidate count
        fixed["capture_graphs"] = args.graphs
    if trace in TRACE_DISTRIBUTIONS:
        fixed.update(trace_distribution=trace, trace_steps=args.steps, trace_max_tokens=args.max_tokens)
    elif Path(trace).is_file():
        fixed["trace_file"] = str(Path(trace).resolve())
    else:
        raise SweepError(f"capture-search: TRACE {trace!r} is neither a CSV file nor a distribution "
                         f"({', '.join(TRACE_DISTRIBUTIONS)})")
    if args.largest is not None:
        fixed["capture_largest"] = args.largest
    if args.keep:
        fixed["capture_keep"] = args.keep
    return fixed


def _overridden_key(expr: str) -> str | None:
    """The parameter a `KEY=VALUE` sets (`hidden`, `fixed.hidden`, `axes.hidden`), None for a non-parameter key."""
    path = [k for k in expr.partition("=")[0].strip().split(".") if k]
    if len(path) == 1:
        return path[0]
    return path[1] if len(path) == 2 and path[0] in ("fixed", "axes") else None


def size_layer_overrides(size: str) -> list[str]:
    """The bundled scenario's size `size` as `--set` expressions, less the keys of the command's question; a size the
    scenario does not declare is refused naming those it has."""
    bundled = bundled_sweep_dir()
    if bundled is None:
        raise SweepError(f"--size {size}: the bundled sweeps (and {SCENARIO}'s sizes) are not installed")
    scenario = bundled / SCENARIO
    return [expr for expr in size_overrides(scenario, size) if _overridden_key(expr) not in QUESTION_KEYS]


def capture_search_sweep(args) -> dict:
    """The one-point sweep `moebench capture-search` runs (target serving_trace, impl serving_trace.capture_search):
    the options' question, then the size's keys (`--size`), then --shape-timings and each --set."""
    raw = {"name": "capture_search", "target": "serving_trace", "impls": ["serving_trace.capture_search"],
           "fixed": _question(args), "timing": {"mode": "cuda_graph", "warmup": 2, "iters": 20}}
    size = getattr(args, "size", None)
    if size is not None:
        raw = apply_overrides(raw, size_layer_overrides(size))
    if args.shape_timings is not None:
        raw["fixed"]["trace_shape_timings"] = args.shape_timings
    return apply_overrides(raw, args.set or [])
