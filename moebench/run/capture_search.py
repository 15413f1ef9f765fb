"""`moebench capture-search`'s sweep: the one point of serving_trace.capture_search its options describe (the command
line runs it and prints its table, plot and headline)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moebench.run.sweep import SweepError


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def capture_search_sweep(args) -> dict:
    """The one-point sweep `moebench capture-search` runs (target serving_trace, impl serving_trace.capture_search)."""
    from moebench.traces.distributions import SERVING_MIXES

    trace = args.trace
    fixed = {"model": args.model, "ep_size": args.ep_size, "dp_size": args.dp_size, "sp_size": args.sp_size,
             "dbo": args.dbo, "padding_fill": args.fill, "seed": args.seed, "trace_real_points": 0}
    if args.graphs is not None:  # else the sweep key's default: 1, 2, 4, ... up to the candidate count
        fixed["capture_graphs"] = args.graphs
    if trace in (*SERVING_MIXES, "uniform", "decode_prefill", "lognormal"):
        fixed.update(trace_distribution=trace, trace_steps=args.steps, trace_max_tokens=args.max_tokens)
    elif Path(trace).is_file():
        fixed["trace_file"] = str(Path(trace).resolve())
    else:
        raise SweepError(f"capture-search: TRACE {trace!r} is neither a CSV file nor a distribution "
                         f"({', '.join((*SERVING_MIXES, 'uniform', 'decode_prefill', 'lognormal'))})")
    if args.largest is not None:
        fixed["capture_largest"] = args.largest
    if args.keep:
        fixed["capture_keep"] = args.keep
    if args.shape_timings is not None:
        fixed["trace_shape_timings"] = args.shape_timings
    for item in args.set or []:  # KEY=VALUE (a YAML value) into the point's fixed keys, after the options
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SweepError(f"capture-search --set {item!r}: expected KEY=VALUE")
        import yaml

        fixed[key.strip()] = yaml.safe_load(text)
    return {"name": "capture_search", "target": "serving_trace", "impls": ["serving_trace.capture_search"],
            "fixed": fixed, "timing": {"mode": "cuda_graph", "warmup": 2, "iters": 20}}
