"""A run's description from its resolved parameters, where the sweep's prose does not hold for the run.

A sweep's `description` is written for its full size ("SP padding in prefill on EP 16 over two nodes"); the same
sweep at `--size cpu`, or with `--set`, runs other parameters. `contradictions` finds the claims of the prose that
the records' parameters (and, for a trace, the trace the records say they ran: info.trace) contradict: EP / DP / SP
sizes, top_k, the expert count, the number of nodes, a trace's distribution and its length. Where there is any,
the report shows `derived` (built from the parameters alone) and names what the prose got wrong.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
DISTRIBUTIONS = ("chat", "mixed", "prefill_heavy", "uniform", "decode_prefill", "lognormal")
# (pattern whose group 1 is a number, the parameter it claims)
NUMERIC_CLAIMS = ((r"\bEP\s*(\d+)", "ep_size"), (r"\bDP\s*(\d+)", "dp_size"), (r"\bSP\s*(\d+)", "sp_size"),
                  (r"\btop[-_ ]?k?\s*(\d+)\b", "top_k"), (r"\b(\d+)\s+(?:routed\s+)?experts\b", "num_experts"))


def _values(records: list[dict], key: str) -> list[Any]:
    out: list[Any] = []
    for r in records:
        v = (r.get("params") or {}).get(key)
        if v is not None and v not in out:
            out.append(v)
    return out


def _traces(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        t = (r.get("info") or {}).get("trace")
        if isinstance(t, dict) and t not in out:
            out.append(t)
    return out


def _number(word: str) -> int | None:
    return int(word) if word.isdigit() else NUMBER_WORDS.get(word.lower())


def contradictions(description: str, records: list[dict]) -> list[str]:
    """The description's claims the records' parameters contradict, each as "claim (the run: values)"."""
    out = []
    for pattern, key in NUMERIC_CLAIMS:
        have = _values(records, key)
        for m in re.finditer(pattern, description):
            if have and int(m.group(1)) not in have:
                out.append(f"{m.group(0).strip()} (the run: {key} {', '.join(map(str, have))})")
    m = re.search(r"\bover (\w+) nodes\b", description)
    if m and _number(m.group(1)) is not None:
        per_node = _values(records, "ranks_per_node") or [8]
        nodes = sorted({math.ceil(ep / rpn) for ep in _values(records, "ep_size") for rpn in per_node})
        if nodes and _number(m.group(1)) not in nodes:
            out.append(f"{m.group(0)} (the run: {', '.join(map(str, nodes))} node{'s' if nodes != [1] else ''})")
    traces = _traces(records)
    for m in re.finditer(r"\b(\w+[-_]?\w*)\s+trace\b", description):
        name = m.group(1).replace("-", "_")
        sources = [str(t.get("source")) for t in traces]
        if name in DISTRIBUTIONS and sources and name not in sources:
            out.append(f"{m.group(0)} (the run: a trace from {', '.join(sources)})")
    for m in re.finditer(r"\b(\d+)\s+steps\b", description):
        steps = [t.get("steps") for t in traces if isinstance(t.get("steps"), int)]
        if steps and int(m.group(1)) not in steps:
            out.append(f"{m.group(0)} (the run: {', '.join(map(str, steps))} steps)")
    return out


def derived(sweep: dict, records: list[dict]) -> str:
    """What the run is, from its parameters alone: target, model, EP / DP / SP / DBO, experts, the trace, the axes."""
    parts = []
    model = _values(records, "model")
    if model:
        parts.append(f"model {', '.join(map(str, model))}")
    for key, label in (("ep_size", "EP"), ("dp_size", "DP"), ("sp_size", "SP")):
        vals = _values(records, key)
        if vals and vals != [1]:
            parts.append(f"{label} {', '.join(map(str, vals))}")
    dbo = _values(records, "dbo")
    if dbo == [True]:
        parts.append("DBO on")
    experts, top_k = _values(records, "num_experts"), _values(records, "top_k")
    if experts:
        parts.append(f"{', '.join(map(str, experts))} experts" + (f", top_k {', '.join(map(str, top_k))}"
                                                                   if top_k else ""))
    for t in _traces(records)[:3]:
        parts.append(f"trace {t.get('source')}" + (f" ({t['steps']} steps)" if t.get("steps") else ""))
    axes = sweep.get("axes") or {}
    if axes:
        parts.append("over " + "; ".join(f"{k} {json.dumps(v, default=str)}" for k, v in axes.items()))
    return f"{sweep.get('target', '?')}: " + ", ".join(parts)


def description_line(sweep: dict, records: list[dict]) -> str:
    """The sweep's description where the run's parameters agree with it; else the one built from them, naming
    what the prose claims that this run did not run."""
    text = str(sweep.get("description") or "")
    wrong = contradictions(text, records) if text else []
    if not wrong:
        return text
    return (f"{derived(sweep, records)} (from the run's parameters: the sweep's description, for other "
            f"parameters, says {'; '.join(wrong)})")
