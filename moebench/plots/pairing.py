"""Which records are drawn against which: masked vs unmasked modes, and mask-oblivious twins paired with a
mask-aware impl of the same kernel."""

from __future__ import annotations

from moebench.plots.common import hashable, param

# Per mode (see mode_of): masked solid, unmasked dashed, the mask-oblivious twin dashed too unless it shares a
# panel with an unmasked (mask=False) line, then dash-dot (see mode_styles).
MODE_STYLE = {"masked": "-", "unmasked": "--", "oblivious": "--", None: "-"}
MODE_ORDER = ("masked", "unmasked", "oblivious", None)
# Variants preferred as the mask-aware partner of an oblivious twin when a kernel has several mask-aware impls
# (fused_experts.triton, not the eager fused_experts.torch reference).
TWIN_VARIANTS = ("masked", "triton")


def mode_of(r: dict) -> str | None:
    """"masked" / "unmasked" for a mask-aware impl run with mask=True / False, "oblivious" for a mask-oblivious
    twin (record mask_aware false: it ignores the mask param, so that param says nothing), None otherwise."""
    if r.get("mask_aware") is False:
        return "oblivious"
    m = param(r, "mask")
    return ("masked" if m else "unmasked") if isinstance(m, bool) else None


def mask_of(r: dict) -> bool | None:
    """True: padded rows skipped; False: computed like real ones (mask=False or a mask-oblivious impl)."""
    mode = mode_of(r)
    return None if mode is None else mode == "masked"


def kernel_of(r: dict) -> str:
    return str(r.get("kernel") or str(r.get("impl", "")).split(".", 1)[0])


def twin_impls(records: list[dict]) -> dict[str, str]:
    """Mask-oblivious impl -> its mask-aware twin among these records: the same kernel, variant "masked" or
    "triton" first, else the kernel's only mask-aware impl. Oblivious impls without a twin are left out."""
    aware: dict[str, list[str]] = {}
    oblivious: dict[str, str] = {}
    for r in records:
        impl = r.get("impl")
        if r.get("mask_aware") is False:
            oblivious.setdefault(impl, kernel_of(r))
        elif impl not in aware.setdefault(kernel_of(r), []):
            aware[kernel_of(r)].append(impl)
    out = {}
    for impl, kernel in oblivious.items():
        cands = aware.get(kernel, [])
        pick = next((c for v in TWIN_VARIANTS for c in cands if c.split(".", 1)[-1] == v), None)
        if pick is None and len(cands) == 1:
            pick = cands[0]
        if pick is not None:
            out[impl] = pick
    return out


def panel_names(records: list[dict]) -> dict[str, str]:
    """impl -> panel name: a mask-aware impl and its oblivious twin share one panel ("A vs B"), others their own."""
    twins = twin_impls(records)
    joined: dict[str, list[str]] = {}
    for r in records:
        base = twins.get(r["impl"], r["impl"])
        if r["impl"] not in joined.setdefault(base, [base]):
            joined[base].append(r["impl"])
    return {impl: " vs ".join(members) for members in joined.values() for impl in members}


def partner(records: list[dict], rec: dict) -> dict | None:
    """The masked / unmasked partner of `rec` at otherwise equal params: the same impl with the mask flipped, else
    the impl's mask-aware or mask-oblivious twin (layer.masked <-> layer.oblivious)."""
    mode = mode_of(rec)
    twins = twin_impls(records)
    if mode == "masked":
        wanted = [(rec["impl"], ("unmasked",))] + [(o, ("oblivious",)) for o, a in twins.items() if a == rec["impl"]]
    elif mode == "unmasked":
        wanted = [(rec["impl"], ("masked",))]
    elif mode == "oblivious" and rec["impl"] in twins:
        wanted = [(twins[rec["impl"]], ("masked", None))]
    else:
        return None
    same = {k: hashable(v) for k, v in rec["params"].items() if k != "mask"}
    for impl, modes in wanted:
        for r in records:
            if r["impl"] == impl and mode_of(r) in modes and \
                    {k: hashable(v) for k, v in r["params"].items() if k != "mask"} == same:
                return r
    return None


def mode_styles(records: list[dict]) -> dict[str | None, str]:
    styles = dict(MODE_STYLE)
    modes = {mode_of(r) for r in records}
    if "unmasked" in modes and "oblivious" in modes:
        styles["oblivious"] = "-."
    return styles


def series_label(impl: str, mode: str | None) -> str:
    """impl plus its mode word, unless the impl's own name already says it (layer.masked, x.oblivious)."""
    variant = impl.split(".", 1)[-1]
    if mode is None or variant == mode:
        return impl
    return f"{impl} {'mask-oblivious' if mode == 'oblivious' else mode}"
