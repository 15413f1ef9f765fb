"""Saving from the padding mask: p50 with the mask over p50 without it (the same impl at mask=False, or its
declared mask-oblivious twin) vs padding ratio, against the same ratio of the roofline times."""

from __future__ import annotations

from pathlib import Path

from moebench.plots.common import Run, aggregate, param, sorted_unique, split, stat
from moebench.plots.draw import Plot, palette, panel_figure, save_panels
from moebench.plots.pairing import mode_of, twin_impls


def saving_pairs(records: list[dict], twins: dict[str, str]) -> tuple[dict[tuple, tuple[float, float | None]],
                                                                      set[tuple]]:
    """{(panel, num_tokens, padding_ratio): (p50 masked / p50 partner, roofline_us ratio or None)} over records of
    one figure (other params equal), and the (impl, num_tokens, ratio, mode) keys that went into a pair."""
    agg = aggregate(records, lambda r: (r["impl"], param(r, "num_tokens"), param(r, "padding_ratio"),
                                        mode_of(r)))
    pairs: dict[tuple, tuple[float, float | None]] = {}
    used_keys: set[tuple] = set()
    for (impl, tokens, ratio, mode), v in agg.items():
        if mode in ("oblivious", "unmasked") or not v["p50"]:
            continue
        refs = []
        if mode == "masked":
            refs.append((f"{impl}: mask on / off", (impl, tokens, ratio, "unmasked")))
        # the oblivious twin's partner: the impl at mask=True, or without a mask param (then it always masks)
        refs += [(f"{impl} / {o}", (o, tokens, ratio, "oblivious")) for o, a in twins.items() if a == impl]
        for panel, ref_key in refs:
            other = agg.get(ref_key)
            if not other or not other["p50"]:
                continue
            roof = v["roofline_us"] / other["roofline_us"] if v["roofline_us"] and other["roofline_us"] else None
            pairs[(panel, tokens, ratio)] = (v["p50"] / other["p50"], roof)
            used_keys |= {(impl, tokens, ratio, mode), ref_key}
    return pairs, used_keys


def saving_vs_padding(run: Run, out: Path) -> list[Plot]:
    """Pairs a masked point with its unmasked partner at otherwise equal params: the same mask-aware impl at
    mask=False, or the impl's mask-oblivious twin (layer.masked vs layer.oblivious)."""
    recs = [r for r in run.ok if stat(r) is not None]
    twins = twin_impls(recs)
    recs = [r for r in recs if mode_of(r) is not None or r["impl"] in twins.values()]
    dims = ("num_tokens", "padding_ratio", "mask", "impl")
    plots = []
    for group, rs in split(recs, dims):
        pairs, used_keys = saving_pairs(rs, twins)
        if not pairs:
            continue
        panels = list(dict.fromkeys(k[0] for k in pairs))
        tokens_all = sorted_unique(k[1] for k in pairs)
        colors = dict(zip(tokens_all, palette(len(tokens_all), "plasma")))
        ratios_all = sorted_unique(k[2] for k in pairs)
        fig, axes = panel_figure(len(panels), sharey=True)
        for ax, panel in zip(axes.flat, panels):
            ideal_labelled = False
            for tokens in tokens_all:
                pts = sorted((k[2], v) for k, v in pairs.items() if k[0] == panel and k[1] == tokens)
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                ax.plot(xs, [v[0] for _, v in pts], "-", marker="o", ms=3, color=colors[tokens],
                        label=f"T={tokens}")
                roof = [(x, v[1]) for x, v in pts if v[1] is not None]
                if roof:
                    ax.plot([x for x, _ in roof], [y for _, y in roof], "--", color=colors[tokens], alpha=0.8,
                            label=None if ideal_labelled else "ideal: roofline ratio (real work only)")
                    ideal_labelled = True
            lo, hi = min(ratios_all), max(ratios_all)
            grid = [lo + (hi - lo) * i / 20 for i in range(21)] if hi > lo else [lo]
            ax.plot(grid, [1 - x for x in grid], ":", color="grey", label="1 - padding ratio")
            ax.axhline(1.0, color="black", lw=0.8, alpha=0.5)
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("padding ratio (share of rows that are padding)")
            ax.grid(True, alpha=0.3)
        for ax in axes[:, 0]:
            ax.set_ylabel("p50 masked / p50 unmasked or oblivious\n(lower = saving)")
        axes.flat[0].legend(fontsize=7)
        used = [r for r in rs if (r["impl"], param(r, "num_tokens"), param(r, "padding_ratio"), mode_of(r))
                in used_keys]
        plots.append(save_panels(fig, axes, len(panels), run, out, "saving_vs_padding", "Saving from the padding mask",
                                 used, dims, group))
    return plots
