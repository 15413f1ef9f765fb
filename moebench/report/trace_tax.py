"""The headline of a serving_trace run, from its stored records: per engine configuration and capture list, the
MoE layer's time over the trace masked and oblivious, the padding tax, what the masks recover, the expert-GEMM rows
computed for padding, the slowest EP rank's excess caused by padding and the predicted fixed-capacity compiles;
and, where the run sweeps capture lists, the list with the least tax for each configuration.

Every figure is read from a record's `info.headline` (moebench.bench.serving_trace writes it); nothing is re-run.
The runner prints `footer_lines` under its table and `moebench report` shows `table` before anything else.
"""

from __future__ import annotations

from typing import Any

from moebench.report.headline import format_value

TARGET = "serving_trace"
# The engine parameters a what-if over capture lists holds fixed (records differing in any other way are
# different configurations, each with its own best list).
_CONFIG_KEYS = ("model", "num_experts", "top_k", "hidden", "intermediate", "expert_dtype", "ep_size", "dp_size",
                "sp_size", "dbo", "padding_fill", "trace", "trace_file", "trace_distribution", "trace_steps",
                "trace_max_tokens", "seed", "capacity_policy")


def trace_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("target") == TARGET and r.get("status") == "ok"
            and isinstance((r.get("info") or {}).get("headline"), dict)]


def _pct(v: Any) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _ms(v: Any) -> str:
    return "n/a" if v is None else f"{v / 1e3:.4g}"


def _timed(info: dict) -> str:
    """Shapes timed, and how (records from before trace_real_points timed every distinct shape)."""
    n = info.get("trace_real_points") or 0
    timed = info.get("timed_shapes", info["distinct_shapes"])
    return f"{timed}, interpolated N={n}" if n else f"{timed}"


def config_label(r: dict) -> str:
    e = (r.get("info") or {}).get("engine") or {}
    return f"DP {e.get('dp_size')}, SP {e.get('sp_size')}, DBO {'on' if e.get('dbo') else 'off'}, EP {e.get('ep_size')}"


def _config_key(r: dict) -> str:
    params = r.get("params") or {}
    return repr([(k, params.get(k)) for k in _CONFIG_KEYS])


def best_lists(records: list[dict]) -> dict[str, str]:
    """Per configuration (its _config_key): the capture list with the least oblivious padding tax."""
    best: dict[str, tuple[float, str]] = {}
    for r in trace_records(records):
        tax = r["info"]["headline"]["padding_tax"]["oblivious"]
        if tax is None:
            continue
        key = _config_key(r)
        label = r["info"]["engine"]["capture_list"]
        if key not in best or tax < best[key][0]:
            best[key] = (tax, label)
    return {k: v[1] for k, v in best.items()}


HEAD = ["capture list", "engine", "distinct shapes / timed / steps", "layer ms oblivious", "layer ms masked",
        "padding tax oblivious", "padding tax masked", "masks recover", "padded rows", "GEMM rows for padding",
        "EP excess from padding (routes)", "compiles oblivious / masked", "least tax"]


def table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per serving_trace record (HEAD names the columns)."""
    best = best_lists(records)
    rows = []
    for r in trace_records(records):
        info, h = r["info"], r["info"]["headline"]
        label = info["engine"]["capture_list"]
        compiles = h.get("jit_compiles") or {}
        recovered = h.get("recovered_share")
        rows.append([label, config_label(r), f"{info['distinct_shapes']} / {_timed(info)} / {info['trace']['steps']}",
                     _ms(h["layer_us"]["oblivious"]), _ms(h["layer_us"]["masked"]),
                     _pct(h["padding_tax"]["oblivious"]), _pct(h["padding_tax"]["masked"]),
                     f"{_ms(h['recovered_us'])} ms ({_pct(recovered)} of the padding time)",
                     f"{h['padded_rows']} ({_pct(h.get('padding_row_share'))})",
                     f"{h['padding_gemm_rows']['oblivious']} / {h['padding_gemm_rows']['masked']}",
                     format_value(h.get("ep_excess_from_padding")),
                     f"{format_value(compiles.get('oblivious'))} / {format_value(compiles.get('masked'))}",
                     "yes" if best.get(_config_key(r)) == label else ""])
    return HEAD, rows


def footer_lines(records: list[dict]) -> list[str]:
    """The padding-tax lines the runner prints under its table (none for other targets)."""
    recs = trace_records(records)
    if not recs:
        return []
    out = ["padding tax over the trace (oblivious | masked):"]
    for r in recs:
        info, h = r["info"], r["info"]["headline"]
        out.append(f"  {info['engine']['capture_list']} ({config_label(r)}): layer {_ms(h['layer_us']['oblivious'])}"
                   f" | {_ms(h['layer_us']['masked'])} ms, tax {_pct(h['padding_tax']['oblivious'])} | "
                   f"{_pct(h['padding_tax']['masked'])}, masks recover {_pct(h.get('recovered_share'))} of the "
                   f"padding time, {info['distinct_shapes']} distinct shapes ({_timed(info)} timed) over "
                   f"{info['trace']['steps']} steps")
    for key, label in best_lists(records).items():
        example = next(r for r in recs if _config_key(r) == key)
        out.append(f"  least tax ({config_label(example)}): capture list {label}")
    if any(r.get("triton_interpret") for r in recs):
        out.append("  (timed under Triton's CPU interpreter: the times and taxes are a smoke signal, not GPU figures)")
    return out
