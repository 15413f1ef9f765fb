"""Load bars from the routing a record carries: routes per expert and per EP rank, real vs padding, at the
point with the largest padding share, beside its masked / unmasked partner."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from moebench.plots.common import Run, figure_title, fmt_value, is_simulated, param
from moebench.plots.draw import Plot, new_figure, save
from moebench.plots.pairing import mask_of, mode_of, partner, series_label


def padding_share(loads_real: list, loads_pad: list) -> float:
    total = sum(loads_real) + sum(loads_pad)
    return sum(loads_pad) / total if total else 0.0


def pick_load_pair(records: list[dict], real_key: str, pad_key: str) -> list[dict]:
    """[masked, unmasked] (or the one record) for the point whose routes carry the largest padding share."""
    def share(r: dict) -> tuple:
        imb = r["imbalance"]
        return (padding_share(imb[real_key], imb[pad_key]), param(r, "padding_ratio") or 0,
                param(r, "num_tokens") or 0)

    best = max(records, key=share)
    twin = partner(records, best)
    pair = [best] + ([twin] if twin else [])
    return sorted(pair, key=lambda r: mask_of(r) is False)  # masked first (left)


def load_bars(run: Run, out: Path, kind: str, real_key: str, pad_key: str, split_key: str,
              wants: Callable[[dict], bool]) -> list[Plot]:
    recs = []
    for r in run.ok:
        imb = r.get("imbalance")
        if isinstance(imb, dict) and isinstance(imb.get(real_key), list) and isinstance(imb.get(pad_key), list) \
                and len(imb[real_key]) == len(imb[pad_key]) and imb[real_key] and wants(r):
            recs.append(r)
    plots = []
    by_size: dict[int, list[dict]] = {}
    for r in recs:
        by_size.setdefault(len(r["imbalance"][real_key]), []).append(r)
    for size in sorted(by_size)[:4]:
        pair = pick_load_pair(by_size[size], real_key, pad_key)
        fig, axes = new_figure(1, len(pair), panel_w=6.0 if size > 32 else 4.5, sharey=True)
        for ax, r in zip(axes.flat, pair):
            imb = r["imbalance"]
            real, pad = imb[real_key], imb[pad_key]
            xs = list(range(size))
            width = 1.0 if size > 64 else 0.8
            ax.bar(xs, real, width=width, color="tab:blue", label="real token routes")
            ax.bar(xs, pad, width=width, bottom=real, color="tab:orange", label="padding routes")
            totals = [a + b for a, b in zip(real, pad)]
            mean = sum(totals) / size
            ax.axhline(mean, color="black", ls="--", lw=0.8, label=f"mean {mean:.0f}")
            stats = imb.get("rank" if kind == "rank_load" else "expert") or {}
            if kind == "rank_load":
                slow = stats.get("slowest_rank")
                if not isinstance(slow, int) or not 0 <= slow < size:
                    slow = max(range(size), key=lambda i: totals[i])
                ax.bar([slow], [totals[slow]], width=width, fill=False, edgecolor="red", lw=2,
                       label=f"slowest rank {slow}")
                ax.annotate("slowest", (slow, totals[slow]), ha="center", va="bottom", color="red", fontsize=8)
                ax.set_xlabel("EP rank")
                ax.set_xticks(xs)
                ax.set_ylabel("routes received (token-expert pairs)")
            else:
                hot = stats.get("hottest")
                if not isinstance(hot, int) or not 0 <= hot < size:
                    hot = max(range(size), key=lambda i: totals[i])
                ax.annotate(f"hottest: expert {hot}", (hot, totals[hot]), ha="center", va="bottom",
                            color="red", fontsize=8)
                ax.set_xlabel("expert id")
                ax.set_ylabel("routes per expert (token-expert pairs)")
            mom = max(totals) / mean if mean else float("nan")
            share = padding_share(real, pad)
            where = f"T={param(r, 'num_tokens')}, padding ratio {fmt_value(param(r, 'padding_ratio'))}"
            ax.set_title(f"{series_label(r['impl'], mode_of(r))} ({where})\npadding share of routes {share:.0%}, "
                         f"max/mean {mom:.2f}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
        what = "Per-rank load" if kind == "rank_load" else "Per-expert load"
        if kind == "rank_load":
            what += " (computed from the routing" + (", simulated ranks)" if any(is_simulated(r) for r in pair)
                                                     else ")")
        dims = ("mask", "impl")
        title = figure_title(run, what, pair, dims, {})
        path = out / f"{kind}__{split_key}-{size}.png"
        save(fig, path, title)
        plots.append(Plot(kind, path, title, len(pair), {split_key: size}))
    return plots


def expert_load(run: Run, out: Path) -> list[Plot]:
    return load_bars(run, out, "expert_load", "per_expert_real", "per_expert_padding", "num_experts",
                     lambda r: True)


def rank_load(run: Run, out: Path) -> list[Plot]:
    def multi_rank(r: dict) -> bool:
        imb = r["imbalance"]
        ep = imb.get("ep_size") or param(r, "ep_size") or 1
        return ep > 1 and len(imb.get("per_rank_real") or []) > 1

    return load_bars(run, out, "rank_load", "per_rank_real", "per_rank_padding", "ep_size", multi_rank)
