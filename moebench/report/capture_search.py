"""What the operator reads of a capture-search record (`info.capture_search`, serving_trace.capture_search): per K
the chosen list, the trace's time and tax per side, the saving against each named list, the lower bound (every
candidate size captured) and the smallest K within 1% of it, masked and oblivious side by side, and the one-line
headline. A difference smaller than the side's noise (the model's held-out error, or the timings' spread) reads
"within noise"; where no noise estimate exists (one sample a shape, the interpreter) the table says so.

`footer_lines` is what the runner prints under its table (through the command line's end notes) for every run with
a capture-search point: `moebench capture-search`, `moebench run` of the scenario, and either resumed."""

from __future__ import annotations

from moebench.records import SIDES
from moebench.report.cells import columns

IMPL = "serving_trace.capture_search"


def search_records(records: list[dict]) -> list[dict]:
    """The run's capture-search records that hold an answer (status ok)."""
    return [r for r in records if r.get("impl") == IMPL and r.get("status") == "ok"
            and isinstance((r.get("info") or {}).get("capture_search"), dict)]


def footer_lines(records: list[dict]) -> list[str]:
    """Per capture-search point of the run: its table and its headline (none for a run without one). Lines for the
    runner's comments, which start each with `# `."""
    found = search_records(records)
    out: list[str] = []
    for r in found:
        if len(found) > 1:
            out.append(f"point {r.get('point')}:")
        out += table_lines(r["info"])
        # with EP ranks the EP step is what the deployment waits for: its answer first
        if (ep := ep_headline(r["info"])) is not None:
            out.append(f"headline: {ep}")
        out.append(f"headline: {headline(r['info'])}")
    return out


def _noise(view: dict, side: str) -> float | None:
    return view["sides"][side].get("noise_rel")


def _ms(us: float) -> str:
    """Microseconds over a trace as milliseconds (what padding_tax's tables show)."""
    return f"{us / 1e3:.3f}"


def _versus(a: float, b: float, noise: float | None) -> str:
    """a against b in words: `x% saved` (a cheaper), `x% more` (a dearer), and `within noise` where the models
    cannot tell them apart."""
    if not b:
        return "n/a"
    share = (b - a) / b
    word = "the same" if abs(share) < 0.0005 else f"{abs(share):.1%} " + ("saved" if share > 0 else "more")
    if noise is not None and abs(a - b) <= noise * max(a, b):
        return f"{word} (within noise)"
    return word


def _chosen_time(row: dict, side: str) -> float:
    return row["figures"][side]["time_us"]


def _costs_at_most(curve_us: float, target_us: float) -> bool:
    """The curve is recorded to 0.001 us and the named figures unrounded: equal within that rounding."""
    return curve_us <= target_us + 1e-3


def _fewest(view: dict, side: str) -> tuple[int | None, str]:
    """(K, words): the fewest graphs whose best list costs what `fine` costs on `side`, with that list where the
    record keeps it (the curve's lists), else `more than N` for the N the curve reached."""
    curve = view["sides"][side]["curve_us"]
    target = view["named"]["fine"][side]["time_us"]
    k = next((i + 1 for i, v in enumerate(curve) if _costs_at_most(v, target)), None)
    if k is None:
        return None, f"more than {len(curve)}"
    lists = view["sides"][side].get("curve_lists") or []
    shown = f" {_shown(lists[k - 1])}" if len(lists) >= k else ""
    return k, f"{k} graph{'s' if k != 1 else ''}{shown}"


def headline(info: dict) -> str:
    """One line: the fewest graphs the search needs to cost what the engine's `fine` list costs (per side), each
    with its list."""
    cs = info["capture_search"]
    (_, obl), (k_mask, mask) = _fewest(cs, "oblivious"), _fewest(cs, "masked")
    return (f"this rank's layer: {obl} chosen for this trace cost what `fine`'s {cs['named']['fine']['graphs']} "
            f"cost; masked, {mask} "
            f"{'does' if k_mask == 1 else 'do'} "
            f"(within 1% of every size captured: K={cs['sides']['oblivious']['within_1pct_k']} oblivious, "
            f"K={cs['sides']['masked']['within_1pct_k']} masked)")


def _shown(sizes: list[int]) -> str:
    text = ",".join(map(str, sizes)) if len(sizes) <= 12 else ",".join(map(str, sizes[:10])) + f",...,{sizes[-1]}"
    return f"[{text}]"


def _per_k_lines(view: dict, budgets: list[int]) -> list[str]:
    """Per K and side: the list, its time, tax (the layer's view) and eager launches, against `default` and
    `fine`; the columns as wide as their widest cell (a saving `within noise` is wider than a plain one). `view`:
    the layer's (info.capture_search) or the EP step's (its `ep_step`), each with `sides` and `named`."""
    named, with_tax = view["named"], "padding_tax" in view["named"]["default"]["masked"]
    rows = []
    for k in budgets:
        for side in SIDES:
            row = view["sides"][side]["per_k"][str(k)]
            f = row["figures"][side]
            tax = ([] if not with_tax else ["n/a" if f["padding_tax"] is None else f"{f['padding_tax']:.1%}"])
            rows.append([str(k), side, str(row["graphs"]), _ms(f["time_us"]), *tax, _ms(f["eager_launch_us"]),
                         _versus(f["time_us"], named["default"][side]["time_us"], _noise(view, side)),
                         _versus(f["time_us"], named["fine"][side]["time_us"], _noise(view, side)),
                         _shown(row["sizes"])])
    header = ["K", "side", "graphs", "time (ms)", *(["tax"] if with_tax else []), "eager (ms)", "vs default",
              "vs fine", "list"]
    right = [True, False] + [True] * (len(header) - 3) + [False]
    return columns(header, rows, right=right, head_prefix="  ", row_prefix="  ")


def _named_lines(view: dict) -> list[str]:
    """Each named list's time per side against the best list of as many graphs or fewer."""
    rows = []
    for name, figs in view["named"].items():
        cells = [name, str(figs["graphs"])]
        for side in SIDES:
            curve, g = view["sides"][side]["curve_us"], figs["graphs"]
            best = curve[min(g, len(curve)) - 1] if g >= 1 and curve else None
            cells += [_ms(figs[side]["time_us"]),
                      "n/a" if best is None else _versus(best, figs[side]["time_us"], _noise(view, side))]
        rows.append(cells)
    header = ["name", "graphs"] + [h for side in SIDES for h in (f"{side} (ms)", "best <= graphs")]
    lines = columns(header, rows, right=[False] + [True] * (len(header) - 1), head_prefix="", row_prefix="")
    return ["named lists: " + lines[0]] + [" " * len("named lists: ") + line for line in lines[1:]]


def _bound_lines(view: dict) -> list[str]:
    out = []
    for side in SIDES:
        s = view["sides"][side]
        # every candidate captured is the least time only where the price grows with the padded size
        beaten = min(s["curve_us"], default=s["lower_bound_us"]) < s["lower_bound_us"]
        bound = ("every candidate captured (not a lower bound here: a list of fewer graphs costs less, the price "
                 "is not monotone in the padded size)" if beaten else "lower bound (every candidate captured)")
        out.append(f"{side}: {bound} {_ms(s['lower_bound_us'])} ms; smallest K within 1% of it: "
                   f"{s['within_1pct_k']}; noise: " + _noise_word(view, s["noise_rel"]))
    return out


def _noise_word(view: dict, noise: float | None) -> str:
    if view.get("noise_source"):  # the EP step's: the rank model's word
        return f"{view['noise_source']}" + ("" if noise is None else f" {noise:.1%}")
    return "unknown (one sample a shape)" if noise is None else f"{noise:.1%}"


def ep_headline(info: dict) -> str | None:
    """The EP step's answer in one line (None where it was not priced): the fewest graphs that cost what `fine`
    costs per side, and the model's word."""
    ep = info["capture_search"].get("ep_step") or {}
    if not ep.get("sides"):
        return None
    fine = ep["named"]["fine"]
    err = ep["sides"]["masked"]["noise_rel"]
    return (f"EP step: {_fewest(ep, 'oblivious')[1]} chosen cost what `fine`'s {fine['graphs']} cost; masked, "
            f"{_fewest(ep, 'masked')[1]}; its figures: {ep['noise_source']}" + ("" if err is None else f", {err:.1%}"))


def eager_line(eager: dict) -> str:
    """Where the eager steps' price comes from: measured on this layer (its shapes and figures) or the documented
    launch figure."""
    per_call = " | ".join(f"{side} {eager['per_call_us'][side]:.2f}" for side in SIDES if side in eager["per_call_us"])
    launches = eager["launches_per_call"]
    launches = (" | ".join(f"{side} {launches[side]}" for side in SIDES if side in launches)
                if isinstance(launches, dict) else launches)
    head = f"eager steps: {per_call} us a layer call over its graph replay ({launches} launches, " \
           f"{eager['launches_counted']}); "
    got = eager.get("measured")
    if eager.get("source") == "measured" and got:
        shapes = ", ".join(f"({r} rows, {q} real)" for r, q in got["shapes"])
        figs = "; ".join(f"{side} eager " + "/".join(f"{v:.1f}" for v in got["eager_us"][side]) + " us vs graph "
                         + "/".join(f"{v:.1f}" for v in got["graph_us"][side]) + " us" for side in SIDES)
        return head + f"measured on this layer at {shapes}: {figs} (the mean difference, at least 0)"
    return head + f"{eager.get('source')}" + (f" ({eager['note']})" if eager.get("note") else "")


def table_lines(info: dict) -> list[str]:
    """The per-K table, masked and oblivious side by side, then the named lists against the best list of as many or
    fewer graphs, and where the figures come from; where the point has EP ranks, the same over the EP step."""
    cs = info["capture_search"]
    out = [f"capture search: {info['trace']['steps']:,} steps ({info['trace']['distinct_steps']:,} distinct), "
           f"{cs['sides']['masked']['candidates']} candidate sizes; method {cs['sides']['masked']['method']} / "
           f"{cs['sides']['oblivious']['method']}; priced on {cs['card']}"]
    out += ["this rank's MoE layer over the trace (every layer call summed):"] + _per_k_lines(cs, info["budgets"])
    out += _bound_lines(cs) + _named_lines(cs)
    ep = cs.get("ep_step") or {}
    if ep.get("sides"):
        out += [f"the EP step over the trace (the slowest of {info['engine']['ep_size']} EP ranks plus dispatch and "
                f"combine, what an EP deployment waits for; {ep['pairs']:,} (step, size) pairs composed; "
                f"{ep['rank_times']} rank times, {ep['rank_timings']} of {ep['distinct_workloads']:,} workloads "
                f"timed):"] + _per_k_lines(ep, info["budgets"]) + _bound_lines(ep) + _named_lines(ep)
    elif ep.get("not_priced"):
        out.append(f"the EP step: not priced ({ep['not_priced']})")
    out.append(eager_line(cs["eager"]))
    out.append("capture time and graph memory per list: not measured (graphs are the cost side shown)")
    return out
