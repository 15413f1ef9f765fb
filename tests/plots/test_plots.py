"""Plots from a fake run directory written the way the runner writes one (manifest.json + records.jsonl)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from moebench import plots, registry  # noqa: E402
from moebench.params import Params  # noqa: E402
from moebench.plots import pairing  # noqa: E402
from moebench.plots.jit import compiles_counted  # noqa: E402
from moebench.plots.saving import saving_pairs  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stats(p50: float) -> dict:
    return {"p50": p50, "p10": 0.9 * p50, "p90": 1.2 * p50, "min": 0.85 * p50, "max": 1.5 * p50,
            "mean": 1.05 * p50, "cv": 0.05}


def _imbalance(rng: random.Random, num_experts: int, ep_size: int, num_tokens: int, ratio: float, top_k: int,
               masked: bool) -> dict:
    real_rows = num_tokens - int(round(num_tokens * ratio))
    per_real = [0] * num_experts
    for _ in range(real_rows * top_k):
        per_real[rng.randrange(num_experts)] += 1
    per_pad = [0] * num_experts
    if not masked:  # identical padded rows all pick the same top_k experts
        for e in range(top_k):
            per_pad[(7 * e + 3) % num_experts] += num_tokens - real_rows
    per_rank_real = [sum(per_real[r * num_experts // ep_size:(r + 1) * num_experts // ep_size])
                     for r in range(ep_size)]
    per_rank_pad = [sum(per_pad[r * num_experts // ep_size:(r + 1) * num_experts // ep_size])
                    for r in range(ep_size)]
    totals = [a + b for a, b in zip(per_rank_real, per_rank_pad)]
    slowest = max(range(ep_size), key=lambda i: totals[i])
    ex_tot = [a + b for a, b in zip(per_real, per_pad)]
    hottest = max(range(num_experts), key=lambda i: ex_tot[i])
    mean = sum(ex_tot) / num_experts
    return {"per_expert_real": per_real, "per_expert_padding": per_pad, "per_rank_real": per_rank_real,
            "per_rank_padding": per_rank_pad, "ep_size": ep_size,
            "expert": {"max_over_mean": max(ex_tot) / mean, "balancedness": mean / max(ex_tot), "cv": 0.1,
                       "hottest": hottest, "hottest_share": max(ex_tot) / sum(ex_tot)},
            "rank": {"max_over_mean": max(totals) / (sum(totals) / ep_size), "balancedness": 0.9, "cv": 0.1,
                     "slowest_rank": slowest, "slowest_load": totals[slowest], "mean_load": sum(totals) / ep_size,
                     "slowest_excess": totals[slowest] - sum(totals) / ep_size, "slowest_excess_ratio": 0.1},
            "real_only": {"expert": {}, "rank": {}}}


class FakeRun:
    """Builds records.jsonl + manifest.json. Each `add` returns the record so a test can tweak it."""

    def __init__(self, root: Path, name: str = "fake_sweep-20261130T000000Z", sweep: str = "fake_sweep",
                 target: str = "router"):
        self.dir = root / "results" / name
        self.dir.mkdir(parents=True)
        self.sweep, self.target = sweep, target
        self.records: list[dict] = []
        self.rng = random.Random(1234)

    def add(self, impl: str, status: str = "ok", p50: float | None = None, imbalance: bool = True,
            twin_of: str | None = None, **params) -> dict:
        """`twin_of`: the mask-aware impl that `impl` is the mask-oblivious twin of (makes the record's
        mask_aware false), as the runner copies both from the impl's declaration."""
        p = Params(**params).to_dict()
        tokens, ratio = p["num_tokens"], p["padding_ratio"]
        work = tokens * (1 - ratio if p["mask"] else 1.0)
        p50 = p50 if p50 is not None else 3.0 + 0.01 * work * (1.7 if impl.endswith("torch") else 1.0) \
            * (1 + 0.05 * self.rng.random())
        roof = 1.0 + 0.004 * work
        rec = {"point": len(self.records), "key": f"k{len(self.records)}", "impl": impl,
               "kernel": impl.split(".")[0], "variant": impl.split(".")[1], "target": self.target, "params": p,
               "status": status, "reason": "" if status == "ok" else f"{status} on purpose",
               "timing_mode": "cuda_graph", "samples_us": [p50] * 5, "stats": _stats(p50),
               "bytes": int(work * 1024), "flops": 0, "gbps": work * 1024 / p50 / 1e3, "tflops": None,
               "roofline_us": roof, "roof_fraction": roof / p50,
               "imbalance": _imbalance(self.rng, p["num_experts"], p["ep_size"], tokens, ratio, p["top_k"],
                                       p["mask"]) if imbalance else None,
               "jit": None, "stages": {}, "ranks": None, "info": {}, "mask_aware": twin_of is None,
               "twin_of": twin_of}
        self.records.append(rec)
        return rec

    def write(self) -> Path:
        manifest = {"sweep": {"name": self.sweep, "target": self.target, "impls": [], "fixed": {"hidden": 7168, "dtype": "bf16"}, "axes": {},
                              "timing": {"mode": "cuda_graph"}},
                    "gpu": {"name": "NVIDIA H200", "count": 1}, "versions": {"torch": "2.11.0"},
                    "git_commit": "0" * 40, "command": "moebench run fake.yaml"}
        (self.dir / "manifest.json").write_text(json.dumps(manifest))
        with open(self.dir / "records.jsonl", "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        return self.dir


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path} is suspiciously small ({len(data)} bytes)"


def _meta(out: Path) -> dict:
    return json.loads((out / "plots.json").read_text())


def _kinds(paths: list[Path]) -> set[str]:
    return {next(k for k in plots.KINDS if p.name.startswith(k)) for p in paths}


def _router_run(tmp_path: Path) -> FakeRun:
    run = FakeRun(tmp_path)
    for tokens in (64, 512, 4096):
        for ratio in (0.0, 0.5):
            for mask in (True, False):
                for impl in ("topk_softmax.triton", "topk_softmax.torch"):
                    run.add(impl, num_tokens=tokens, padding_ratio=ratio, mask=mask, num_experts=64)
    return run


def test_router_run_makes_its_plots_and_skips_the_rest(tmp_path):
    run = _router_run(tmp_path)
    run.dir.parent  # results/
    paths = plots.make_plots(run.write())
    # default output: plots/<run name>/ beside results/
    out = tmp_path / "plots" / run.dir.name
    assert paths and all(p.parent == out for p in paths)
    for p in paths:
        _assert_png(p)
    # per-rank, layer, EP scaling and JIT plots need data this run does not have: quietly absent
    assert _kinds(paths) == {"latency_vs_tokens", "saving_vs_padding", "expert_load", "roof_fraction"}
    meta = _meta(out)
    assert meta["gpu"] == "NVIDIA H200" and meta["records"]["ok"] == len(run.records)
    lat = [p for p in meta["plots"] if p["kind"] == "latency_vs_tokens"]
    assert len(lat) == 1 and lat[0]["points"] == len(run.records)
    assert "fake_sweep" in lat[0]["title"] and "NVIDIA H200" in lat[0]["title"] and "E=64" in lat[0]["title"]
    index = (out / "index.md").read_text()
    for p in paths:
        assert f"]({p.name})" in index


def test_failed_wrong_skipped_records_are_excluded(tmp_path):
    run = _router_run(tmp_path)
    n_ok = len(run.records)
    for status in ("failed", "wrong", "skipped"):
        # a bad record at a num_tokens of its own, and one with layer stages: neither may be drawn
        run.add("topk_softmax.triton", status=status, p50=1e6, num_tokens=16384, padding_ratio=0.5, mask=True,
                num_experts=64)
        run.add("topk_softmax.triton", status=status, num_tokens=64, padding_ratio=0.0, mask=True,
                num_experts=64)["stages"] = {"route": _stats(1.0)}
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    assert all(p.parent == out for p in paths)
    meta = _meta(out)
    assert meta["records"] == {"ok": n_ok, "wrong": 2, "skipped": 2, "failed": 2}
    assert "layer_stages" not in _kinds(paths)
    for p in meta["plots"]:
        if p["kind"] in ("latency_vs_tokens", "roof_fraction"):
            assert p["points"] == n_ok, p
    assert plots.ok_records(run.records) == run.records[:n_ok]


def test_only_failed_records_give_no_plots(tmp_path):
    run = FakeRun(tmp_path)
    for tokens in (64, 128):
        run.add("topk_softmax.triton", status="failed", num_tokens=tokens)
    out = tmp_path / "out"
    assert plots.make_plots(run.write(), out) == []
    assert "No plot could be made" in (out / "index.md").read_text()


def test_ep_layer_and_jit_plots(tmp_path):
    run = FakeRun(tmp_path, target="layer")
    for ep in (1, 2, 4, 8):
        for mask in (True, False):
            for ratio in (0.0, 0.25, 0.5):
                rec = run.add("layer.triton", num_tokens=256, padding_ratio=ratio, mask=mask, ep_size=ep,
                              num_experts=32, ep_mode="simulated" if ep > 2 else "real")
                rec["ranks"] = {"world_size": min(ep, 2), "slowest_rank": 0, "simulated": ep > 2}
                scale = 1 - ratio if mask else 1.0
                rec["stages"] = {"route": _stats(5 * scale + 1), "align": _stats(8 * scale + 2),
                                 "experts": _stats(40 * scale + 5), "reduce": _stats(6 * scale + 1)}
    for policy, per_step in (("exact", [1, 1, 0, 1, 1, 0, 1, 0]), ("pow2", [1, 1, 0, 0, 1, 0, 0, 0]),
                             ("max", [1, 0, 0, 0, 0, 0, 0, 0])):
        rec = run.add("a2a_fixed.triton", num_tokens=256, capacity_policy=policy, imbalance=False)
        rec["info"] = {"trace_steps": [{"step": i, "batch": 16 * (i % 5 + 1), "compiles": c, "compile_s": 0.4 * c}
                                       for i, c in enumerate(per_step)],
                       "predicted_compiles": sum(per_step)}
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    for p in paths:
        _assert_png(p)
    kinds = _kinds(paths)
    assert {"rank_load", "layer_stages", "ep_scaling", "jit_compiles", "expert_load"} <= kinds
    # one rank-load figure per EP size > 1
    assert sorted(p.name for p in paths if p.name.startswith("rank_load")) == \
        ["rank_load__ep_size-2.png", "rank_load__ep_size-4.png", "rank_load__ep_size-8.png"]
    meta = _meta(out)
    jit = [p for p in meta["plots"] if p["kind"] == "jit_compiles"]
    assert len(jit) == 1 and jit[0]["points"] == 3
    # ep_mode marks simulated points (hollow), it must not split the EP-scaling figure
    assert sum(p["kind"] == "ep_scaling" for p in meta["plots"]) == 1
    # a layer record per (ep, mask, ratio) at EP 1..8 feeds the stage plot, split per EP size
    assert sum(p["kind"] == "layer_stages" for p in meta["plots"]) == 4


def test_extra_axis_splits_figures_and_repeats_fold(tmp_path):
    run = FakeRun(tmp_path)
    for top_k in (4, 8):
        for tokens in (64, 256):
            for repeat in (0, 1):
                run.add("topk_softmax.triton", num_tokens=tokens, top_k=top_k, repeat=repeat, num_experts=64,
                        imbalance=False)
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    names = sorted(p.name for p in paths if p.name.startswith("latency_vs_tokens"))
    assert names == ["latency_vs_tokens__top_k-4.png", "latency_vs_tokens__top_k-8.png"]
    titles = [p["title"] for p in _meta(out)["plots"] if p["kind"] == "latency_vs_tokens"]
    assert all("top_k=" in t for t in titles)
    # no mask variation: no saving plot; no imbalance: no load plots
    assert _kinds(paths) == {"latency_vs_tokens", "roof_fraction"}


def test_replot_removes_stale_images_and_index_alone(tmp_path):
    run = _router_run(tmp_path)
    run_dir = run.write()
    out = tmp_path / "out"
    (out).mkdir()
    (out / "latency_vs_tokens__top_k-99.png").write_bytes(PNG_MAGIC)
    (out / "notes.png").write_bytes(PNG_MAGIC)  # not ours: left alone
    paths = plots.make_plots(run_dir, out)
    assert not (out / "latency_vs_tokens__top_k-99.png").exists()
    assert (out / "notes.png").exists()
    (out / "index.md").unlink()
    index = plots.plot_index(run_dir, out)
    text = index.read_text()
    assert all(p.name in text for p in paths) and "notes.png" not in text


def test_torn_last_line_is_ignored(tmp_path):
    run = _router_run(tmp_path)
    run_dir = run.write()
    with open(run_dir / "records.jsonl", "a") as f:
        f.write('{"point": 99, "status": "ok", "par')
    loaded = plots.load_run(run_dir)
    assert loaded.bad_lines == 1 and len(loaded.ok) == len(run.records)


def test_not_a_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        plots.make_plots(tmp_path)


def _twin_layer_run(tmp_path: Path) -> FakeRun:
    """The layer sweep's shape: layer.masked vs its mask-oblivious twin, both at the default mask=True param."""
    run = FakeRun(tmp_path, name="layer-20261130T000000Z", sweep="layer", target="layer")
    for local in (32, 64):
        for tokens in (256, 1024):
            for ratio in (0.0, 0.25, 0.5):
                for impl, twin_of in (("layer.masked", None), ("layer.oblivious", "layer.masked")):
                    work = tokens * ((1 - ratio) if twin_of is None else 1.0)
                    rec = run.add(impl, p50=5.0 + 0.1 * work, num_tokens=tokens, padding_ratio=ratio, mask=True,
                                  num_experts=64, num_local_experts=local, twin_of=twin_of)
                    rec["roofline_us"] = 1.0 + 0.05 * work
                    rec["roof_fraction"] = rec["roofline_us"] / rec["stats"]["p50"]
    return run


def test_mask_aware_vs_oblivious_twins_make_the_saving_plot(tmp_path):
    run = _twin_layer_run(tmp_path)
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    for p in paths:
        _assert_png(p)
    names = sorted(p.name for p in paths if p.name.startswith("saving_vs_padding"))
    assert names == ["saving_vs_padding__num_local_experts-32.png", "saving_vs_padding__num_local_experts-64.png"]
    meta = _meta(out)
    saving = [p for p in meta["plots"] if p["kind"] == "saving_vs_padding"]
    assert all(p["points"] == len(run.records) // 2 for p in saving)
    # one latency panel per twin pair: its records are drawn together
    lat = [p for p in meta["plots"] if p["kind"] == "latency_vs_tokens"]
    assert len(lat) == 2 and all(p["points"] == len(run.records) // 2 for p in lat)
    # the ratios drawn: masked / oblivious p50 and the same ratio of roofline_us
    recs = [r for r in run.records if r["params"]["num_local_experts"] == 32]
    assert pairing.twin_impls(recs) == {"layer.oblivious": "layer.masked"}
    assert pairing.panel_names(recs) == {"layer.masked": "layer.masked vs layer.oblivious",
                                   "layer.oblivious": "layer.masked vs layer.oblivious"}
    pairs, used = saving_pairs(recs, pairing.twin_impls(recs))
    assert len(pairs) == 6 and len(used) == 12
    for (panel, tokens, ratio), (measured, roof) in pairs.items():
        assert panel == "layer.masked / layer.oblivious"
        work = tokens * (1 - ratio)
        assert measured == pytest.approx((5.0 + 0.1 * work) / (5.0 + 0.1 * tokens))
        assert roof == pytest.approx((1.0 + 0.05 * work) / (1.0 + 0.05 * tokens))
    # the load plot pairs the masked point with its oblivious twin at equal params
    best = max(recs, key=lambda r: (r["params"]["padding_ratio"], r["params"]["num_tokens"], r["impl"]))
    twin = pairing.partner(recs, best)
    assert twin is not None and twin["impl"] != best["impl"] and twin["params"] == best["params"]


def test_mask_param_and_twin_impl_pairings_side_by_side(tmp_path):
    run = FakeRun(tmp_path, target="kernel")
    for ratio in (0.0, 0.5):
        for tokens in (64, 256):
            for impl, masks in (("fused_experts.triton", (True, False)), ("fused_experts.torch", (True, False)),
                                ("fused_experts.oblivious", (True,))):
                for mask in masks:
                    run.add(impl, num_tokens=tokens, padding_ratio=ratio, mask=mask, num_experts=64,
                            imbalance=False,
                            twin_of="fused_experts.triton" if impl == "fused_experts.oblivious" else None)
    recs = run.records
    # the oblivious twin pairs with the impl it declares (the Triton kernel), not the eager torch reference
    assert pairing.twin_impls(recs) == {"fused_experts.oblivious": "fused_experts.triton"}
    assert pairing.mode_of(recs[-1]) == "oblivious" and pairing.mask_of(recs[-1]) is False
    pairs, _ = saving_pairs(recs, pairing.twin_impls(recs))
    assert {k[0] for k in pairs} == {"fused_experts.triton: mask on / off", "fused_experts.torch: mask on / off",
                                     "fused_experts.triton / fused_experts.oblivious"}
    assert len(pairs) == 3 * 4
    p50 = {(r["impl"], r["params"]["num_tokens"], r["params"]["padding_ratio"], pairing.mode_of(r)):
           r["stats"]["p50"] for r in recs}
    measured, _ = pairs[("fused_experts.triton / fused_experts.oblivious", 256, 0.5)]
    assert measured == pytest.approx(p50[("fused_experts.triton", 256, 0.5, "masked")]
                                     / p50[("fused_experts.oblivious", 256, 0.5, "oblivious")])
    # unmasked (mask=False) and oblivious lines share a panel: told apart by their line style
    styles = pairing.mode_styles(recs)
    assert len({styles["masked"], styles["unmasked"], styles["oblivious"]}) == 3
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    assert "saving_vs_padding" in _kinds(paths)
    for p in paths:
        _assert_png(p)


def test_twins_pair_by_declaration_never_by_name(tmp_path):
    run = FakeRun(tmp_path, target="kernel")
    for tokens in (64, 256):
        for impl, twin_of in (("fused_experts.triton", None), ("fused_experts.torch", None),
                              ("fused_experts.oblivious", "fused_experts.torch"),  # declares the torch impl
                              ("masked_moe_sum.triton", None),
                              ("masked_moe_sum.oblivious", None),  # mask-oblivious, declares no twin
                              ("moe_align_block_size.oblivious", "moe_align_block_size.triton")):  # twin absent
            rec = run.add(impl, num_tokens=tokens, padding_ratio=0.5, mask=True, num_experts=64, imbalance=False,
                          twin_of=twin_of)
            rec["mask_aware"] = twin_of is None and impl.split(".")[1] != "oblivious"
    recs = run.records
    assert pairing.twin_impls(recs) == {"fused_experts.oblivious": "fused_experts.torch"}
    names = pairing.panel_names(recs)
    assert names["fused_experts.oblivious"] == names["fused_experts.torch"] == \
        "fused_experts.torch vs fused_experts.oblivious"
    assert names["fused_experts.triton"] == "fused_experts.triton"
    assert names["masked_moe_sum.oblivious"] == "masked_moe_sum.oblivious"
    assert names["moe_align_block_size.oblivious"] == "moe_align_block_size.oblivious"
    pairs, _ = saving_pairs(recs, pairing.twin_impls(recs))
    assert {k[0] for k in pairs} == {"fused_experts.torch / fused_experts.oblivious"}
    undeclared = next(r for r in recs if r["impl"] == "masked_moe_sum.oblivious")
    assert pairing.partner(recs, undeclared) is None


def _without_twin_of(records: list[dict]) -> list[dict]:
    """Records as runs before `twin_of` was recorded wrote them."""
    return [{k: v for k, v in r.items() if k != "twin_of"} for r in records]


def test_records_without_twin_of_fall_back_to_the_registry(tmp_path, monkeypatch):
    old = _without_twin_of([r for r in _twin_layer_run(tmp_path).records
                            if r["params"]["num_local_experts"] == 32])

    def build(p, ctx):
        raise AssertionError("plots never build an impl")

    declared = {"layer.oblivious": registry.Impl("layer.oblivious", targets=("layer",), build=build,
                                                 mask_aware=False, twin_of="layer.masked")}
    monkeypatch.setattr(registry, "all_impls", lambda: declared)
    assert pairing.twin_impls(old) == {"layer.oblivious": "layer.masked"}
    pairs, _ = saving_pairs(old, pairing.twin_impls(old))
    assert {k[0] for k in pairs} == {"layer.masked / layer.oblivious"} and len(pairs) == 6

    # the impl unknown to the registry, or declaring no twin there: not paired, whatever its name says
    monkeypatch.setattr(registry, "all_impls", lambda: {})
    assert pairing.twin_impls(old) == {}
    assert pairing.panel_names(old) == {"layer.masked": "layer.masked", "layer.oblivious": "layer.oblivious"}
    declared["layer.oblivious"] = registry.Impl("layer.oblivious", targets=("layer",), build=build,
                                                mask_aware=False)
    monkeypatch.setattr(registry, "all_impls", lambda: declared)
    assert pairing.twin_impls(old) == {}

    # a record's own twin_of wins over the registry (even a null one: the impl was nobody's twin then)
    recorded = [dict(r, twin_of=None) for r in old]
    declared["layer.oblivious"] = registry.Impl("layer.oblivious", targets=("layer",), build=build,
                                                mask_aware=False, twin_of="layer.masked")
    assert pairing.twin_impls(recorded) == {}


def test_unpaired_twins_make_no_saving_plot(tmp_path, monkeypatch):
    """End to end: the layer sweep's records without twin_of and an empty registry draw the two impls apart."""
    run = _twin_layer_run(tmp_path)
    run.records = _without_twin_of(run.records)
    monkeypatch.setattr(registry, "all_impls", lambda: {})
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    assert "saving_vs_padding" not in _kinds(paths)
    lat = [p for p in _meta(out)["plots"] if p["kind"] == "latency_vs_tokens"]
    assert len(lat) == 2 and all(p["points"] == len(run.records) // 2 for p in lat)


def test_figure_kinds_are_unique_and_none_prefixes_another():
    """A figure's files are found by their kind's prefix (stale-file removal, the index): no kind may be a
    prefix of another's, or re-plotting one would delete or list the other's images."""
    kinds = [f.kind for f in plots.FIGURES]
    assert len(set(kinds)) == len(kinds) and all(f.blurb for f in plots.FIGURES)
    assert not [(a, b) for a in kinds for b in kinds if a != b and b.startswith(a)]


def _jit_record(run: FakeRun, policy: str, counted: bool) -> dict:
    per_step = [1, 1, 0, 1, 0, 0]
    rec = run.add("jit_trace.a2a_fixed", num_tokens=256, capacity_policy=policy, imbalance=False)
    steps = [{"step": i, "batch": 16 * (i % 4 + 1), "capacity": 32,
              "compiles": c if counted else None, "compile_s": 0.3 * c if counted else None}
             for i, c in enumerate(per_step)]
    rec["info"] = {"trace_steps": steps, "predicted_compiles": sum(per_step),
                   "observed_compiles": sum(per_step) if counted else "unsupported"}
    return rec


def test_jit_records_without_compile_counts_are_not_drawn(tmp_path):
    run = FakeRun(tmp_path, target="jit_trace")
    _jit_record(run, "exact", counted=True)
    _jit_record(run, "pow2", counted=False)
    uncounted = _jit_record(run, "max", counted=True)
    uncounted["info"]["trace_steps"][2]["compiles"] = "unsupported"  # one step unknown: the curve is unknown
    assert [compiles_counted(r) for r in run.records] == [True, False, False]
    out = tmp_path / "out"
    paths = plots.make_plots(run.write(), out)
    jit = [p for p in _meta(out)["plots"] if p["kind"] == "jit_compiles"]
    assert len(jit) == 1 and jit[0]["points"] == 1
    _assert_png(out / jit[0]["file"])

    # a CPU run where nothing could be counted: no compiles plot at all rather than flat zeros
    cpu = FakeRun(tmp_path / "cpu", target="jit_trace")
    for policy in ("exact", "pow2"):
        _jit_record(cpu, policy, counted=False)
    out_cpu = tmp_path / "out_cpu"
    assert "jit_compiles" not in _kinds(plots.make_plots(cpu.write(), out_cpu))


def test_titles_name_the_timing_mode_as_the_table_does():
    """A CPU run's figures say their timings come from the interpreter (the table's `interp`), not plain `wall`."""
    from moebench.plots.common import timing_subtitle

    interp = [{"timing_mode": "wall", "triton_interpret": True, "device": "cpu"}] * 2
    assert timing_subtitle(interp) == "timing: interp (Triton interpreter on CPU, not GPU figures)"
    assert timing_subtitle([{"timing_mode": "wall", "device": "cpu"}]) == "timing: wall (CPU, not GPU figures)"
    assert timing_subtitle([{"timing_mode": "cuda_graph", "device": "cuda:0"}]) == "timing: graph"
    assert timing_subtitle([{"timing_mode": "wall", "device": "cuda"}]) == "timing: wall"
    assert timing_subtitle([{"timing_mode": "events"}, {"timing_mode": "cuda_graph"}]) == ""


def test_titles_never_give_a_preset_name_to_overridden_dims():
    """`--size cpu` or --set ran deepseek-v3's name with E=8, H=64: the title says what overrode the preset."""
    from moebench.plots.common import constant_params
    from moebench.presets import get_preset

    preset = {"model": "deepseek-v3", **get_preset("deepseek-v3").values}
    small = {**preset, "num_experts": 8, "hidden": 64, "padding_fill": "repeat"}
    fixed = ["model", "num_experts", "hidden", "padding_fill"]
    title = constant_params([{"params": small}], (), fixed)
    assert title == "model=deepseek-v3 (overridden: E=8, H=64), top_k=8, fill=repeat", title
    assert constant_params([{"params": preset}], (), fixed) == "model=deepseek-v3, E=256, top_k=8, H=7168"
    varied = constant_params([{"params": small}, {"params": {**small, "hidden": 128}}], ("hidden",), fixed)
    assert varied.startswith("model=deepseek-v3 (overridden: E=8, H), top_k=8"), varied
