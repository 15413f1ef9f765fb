"""Which records are drawn against which: masked vs unmasked modes, and mask-oblivious twins paired with the
mask-aware impl they declare (`twin_of`), never by their names.

A record names its twin in `twin_of` (the runner writes the impl's declaration into every record: null for an
impl that is nobody's twin). Records written before that field existed are looked up in the registry by impl
name; an impl unknown there too is not paired.
"""

from __future__ import annotations

from moebench.plots.common import hashable, param

# Per mode (see mode_of): masked solid, unmasked dashed, the mask-oblivious twin dashed too unless it shares a
# panel with an unmasked (mask=False) line, then dash-dot (see mode_styles).
MODE_STYLE = {"masked": "-", "unmasked": "--", "oblivious": "--", None: "-"}
MODE_ORDER = ("masked", "unmasked", "oblivious", None)


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


def declared_twin(r: dict) -> str | None:
    """The mask-aware impl this record's impl is the mask-oblivious twin of, as declared: the record's own
    `twin_of`, else (a record older than that field) the registry's declaration, else None."""
    if "twin_of" in r:
        return r["twin_of"] or None
    from moebench import registry

    try:
        impl = registry.all_impls().get(r.get("impl"))
    except ImportError:  # plotting stored records needs no kernels: without them an old record stays unpaired
        return None
    return impl.twin_of if impl is not None else None


def twin_impls(records: list[dict]) -> dict[str, str]:
    """Mask-oblivious impl -> the mask-aware impl it declares as its twin, for the twins whose partner has
    records here too (others are left out)."""
    declared: dict[str, str | None] = {}
    present = set()
    for r in records:
        impl = r.get("impl")
        present.add(impl)
        if impl not in declared:
            declared[impl] = declared_twin(r) if mode_of(r) == "oblivious" else None
    return {impl: twin for impl, twin in declared.items() if twin is not None and twin in present}


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
