"""The seven seed scenarios (sweeps/scenarios/*.yaml) at small shapes on the CPU, each asserting its headline effect
with and without the fix, plus the `headlines:` sweep key (validation, evaluation) and the runner's footer."""

import io
from pathlib import Path

import pytest

from moebench.report import headline
from moebench.cli import main
from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import SweepError, load_sweep, sweep_from_dict

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "sweeps" / "scenarios"
FAST = ["timing.iters=1", "timing.warmup=0", "timing.unroll=1"]

# Every scenario runs at its `--size cpu` (the files' own shapes are the H200 ones; docs/scenarios.md names it).
SIZE = "cpu"


def _run(name: str, tmp_path) -> tuple[dict[str, headline.HeadlineRow], int, list[dict]]:
    sweep = load_sweep(SCENARIOS / f"{name}.yaml", FAST, size=SIZE)
    out = io.StringIO()
    code, run_dir = run_sweep(sweep, out_base=tmp_path, device="cpu", out=out)
    records = load_records(run_dir)
    rows = headline.evaluate(records, list(sweep.headlines))
    text = out.getvalue()
    assert "# headlines (without the fix | with it):" in text
    for row in rows:  # every headline is printed under the table
        assert f"#   {headline.line(row)}" in text
    return {r.label: r for r in rows}, code, records


def _by_prefix(rows: dict, prefix: str) -> headline.HeadlineRow:
    hits = [r for label, r in rows.items() if label.startswith(prefix)]
    assert len(hits) == 1, (prefix, list(rows))
    return hits[0]


def _assert_fixed(rows: dict, *prefixes: str) -> None:
    """Each headline named by a prefix shows harm without the fix and none with it."""
    for prefix in prefixes:
        row = _by_prefix(rows, prefix)
        assert row.without > 0 and row.with_ == 0, prefix


def test_every_scenario_has_a_small_shape_and_headlines():
    files = sorted(p.stem for p in SCENARIOS.glob("*.yaml"))
    for name in files:
        sweep = load_sweep(SCENARIOS / f"{name}.yaml")
        assert sweep.name == name and sweep.headlines and SIZE in sweep.sizes, name
        doc = (ROOT / "docs" / "scenarios.md").read_text()
        assert f"sweeps/scenarios/{name}.yaml" in doc, name


def test_a_sp_padding_straggler(tmp_path):
    rows, code, _ = _run("sp_padding_straggler", tmp_path)
    assert code == 0
    excess = _by_prefix(rows, "slowest-rank excess")
    assert excess.without > excess.with_ >= 0
    assert excess.equal is True  # masked == the unmasked run's real tokens alone, exactly
    hot = _by_prefix(rows, "hottest expert")
    assert hot.without > hot.with_ and hot.equal is True
    _assert_fixed(rows, "padding routes")


def test_a_sp_padding_on_two_real_ranks(tmp_path):
    rows, code, records = _run("sp_padding_ep2_real", tmp_path)  # two gloo ranks on the CPU
    assert code == 0 and all(r["status"] == "ok" for r in records)
    _assert_fixed(rows, "padded rows sent")
    assert _by_prefix(rows, "slowest rank's excess").equal is True
    assert _by_prefix(rows, "hottest expert").equal is True


def test_b_capacity_compiles(tmp_path):
    rows, code, records = _run("capacity_compiles", tmp_path)
    assert code == 0
    pow2 = _by_prefix(rows, "pack/combine variants to compile (distinct")
    assert pow2.without > pow2.with_ >= 1
    whole = _by_prefix(rows, "pack/combine variants to compile, whole buffer")
    assert whole.without > whole.with_ == 1
    wire = _by_prefix(rows, "wire bytes")
    assert wire.with_ > wire.without > 0  # the price of fewer compiles: larger blocks on the wire
    for label in ("wire copy time over the trace (us)", "wire copy time over the trace, whole buffer (us)"):
        assert rows[label].without > 0 and rows[label].with_ > 0
    # under the interpreter the JIT hooks never fire: shown as n/a, not as 0
    assert _by_prefix(rows, "pack compiles observed").without is None
    policies = {r["params"]["capacity_policy"]: r["info"]["wire_rows"] for r in records
                if r["impl"] == "jit_trace.a2a_fixed_wire"}
    assert policies["max"] >= policies["pow2"] >= policies["exact"]


def test_c_recv_buffer_stale_rows(tmp_path):
    rows, code, _ = _run("recv_buffer_stale_rows", tmp_path)
    assert code == 0
    _assert_fixed(rows, "receive-buffer rows with wrong ids", "stale routes", "expert-output rows that differ")


def test_d_pcp_gathered_mask(tmp_path):
    rows, code, records = _run("pcp_gathered_mask", tmp_path)
    assert code == 1  # the rank-local mask's points fail, as in the seed: recorded, the run went on
    failed = _by_prefix(rows, "masked points failing")
    assert failed.without == 2 and failed.with_ == 0  # PCP 2, both impls; PCP 1 works either way
    reasons = _by_prefix(rows, "their reason").without
    assert reasons and all("is_padding size mismatch" in r for r in reasons)
    assert _by_prefix(rows, "padded rows' routes").without > 0 == _by_prefix(rows, "padded rows' routes").with_
    routing = _by_prefix(rows, "real tokens' routes")
    assert routing.equal is True, routing.equal_detail
    assert all(r["status"] == "ok" for r in records if r["params"]["pcp_mask"] == "gathered")


def test_e_topk6(tmp_path):
    rows, code, records = _run("topk6", tmp_path)
    assert code == 0
    bad = _by_prefix(rows, "points wrong or failed")
    assert bad.without == 0 and bad.with_ == 0
    timed = _by_prefix(rows, "points checked")
    assert timed.without == timed.with_ == 2
    assert {r["params"]["top_k"] for r in records} == {6, 8}
    assert _by_prefix(rows, "router p50").with_ > 0 and _by_prefix(rows, "moe_align_block_size p50").with_ > 0


def test_f_minus_one_and_nan(tmp_path):
    rows, code, _ = _run("minus_one_and_nan", tmp_path)
    assert code == 0
    _assert_fixed(rows, "padded slots routed", "rows with a wrong local id", "NaN output rows")
    # every padded slot is misrouted on the rank owning the last expert: 8 padded rows x top-4
    assert _by_prefix(rows, "padded slots routed").without == 8 * 4


def test_g_dbo_mask_slices_through_the_cli(tmp_path, capsys):
    argv = ["run", str(SCENARIOS / "dbo_mask_slices.yaml"), "--out", str(tmp_path), "--no-plots", "--device", "cpu",
            "--size", SIZE]
    for s in FAST:
        argv += ["--set", s]
    code = main(argv)
    stdout, stderr = capsys.readouterr()
    assert code == 1, stderr  # the full-mask point fails (size mismatch), by design
    assert "is_padding size mismatch" in stdout
    run_dir = next(tmp_path.iterdir())
    sweep = load_sweep(SCENARIOS / "dbo_mask_slices.yaml")
    rows = {r.label: r for r in headline.evaluate(load_records(run_dir), list(sweep.headlines))}
    pad = _by_prefix(rows, "padded rows' routes")
    assert pad.without > 0 and pad.with_ == 0
    for prefix in ("hottest expert", "slowest EP rank"):
        row = _by_prefix(rows, prefix)
        assert row.without > row.with_ and row.equal is True, prefix
    assert _by_prefix(rows, "points failing").without == 1
    assert f"#   {headline.line(pad)}" in stdout


# ------------------------------------------------------------------------------------------ the headlines key

BASE = {"name": "h", "target": "router", "impls": ["topk_softmax.torch"],
        "fixed": {"num_experts": 16, "top_k": 2, "num_tokens": 8}, "axes": {"mask": [True, False]}}
HEADLINE = {"label": "x", "metric": "imbalance.num_padding_routes", "reduce": "sum", "without": {"mask": False},
        "with": {"mask": True}}


@pytest.mark.parametrize("spec, why", [
    ({**HEADLINE, "reduce": "avg"}, "reduce: 'avg' is not one of"),
    ({**HEADLINE, "without": {"maks": False}}, "without.maks: not a parameter"),
    ({**HEADLINE, "with": {"impl": "topk_softmax.triton"}}, "with.impl: 'topk_softmax.triton' is not an impl of"),
    ({k: v for k, v in HEADLINE.items() if k != "with"}, "with: missing"),
    ({**HEADLINE, "colour": "red"}, "colour: unknown key"),
    ({**HEADLINE, "metric": "a..b"}, "metric: 'a..b' is not a dotted path"),
    ({**HEADLINE, "without": [1]}, "without: expected dict"),
    ("just text", "expected a mapping"),
])
def test_bad_headlines_are_one_line_errors(spec, why):
    with pytest.raises(SweepError) as e:
        sweep_from_dict({**BASE, "headlines": [spec]}, "s.yaml")
    msg = str(e.value)
    assert msg.startswith("s.yaml: headlines[0]: ") and why in msg and "\n" not in msg


def test_bad_headlines_exit_2_from_the_cli(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: h\ntarget: router\nimpls: [topk_softmax.torch]\nheadlines:\n  - {label: x, metric: status,"
                   " reduce: nope, without: {}, with: {}}\n")
    assert main(["run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "headlines[0]: reduce" in err


def test_headlines_survive_the_manifest_round_trip():
    sweep = sweep_from_dict({**BASE, "headlines": [HEADLINE]})
    again = sweep_from_dict(sweep.to_dict())
    assert list(again.headlines) == [HEADLINE]


def _rec(point, status="ok", **params):
    return {"point": point, "impl": "k.v", "status": status, "params": {"mask": True, "ep_size": 1, **params},
            "info": {"n": point}, "reason": "boom" if status == "failed" else ""}


def test_evaluate_reduces_pairs_and_missing_values():
    recs = [_rec(0, mask=False, ep_size=2), _rec(1, mask=True, ep_size=2), _rec(2, mask=False, ep_size=4),
            _rec(3, "failed", mask=True, ep_size=4)]
    spec = {"label": "n", "metric": "info.n", "reduce": "max", "without": {"mask": False}, "with": {"mask": True}}
    row = headline.evaluate(recs, [spec])[0]
    assert (row.without, row.with_, row.n_without, row.n_with, row.change) == (2, 3, 2, 2, "0.667x")
    assert headline.reduce_values([1, None, 3], "mean") == 2
    assert headline.reduce_values(["a", "b", "a"], "distinct") == ["a", "b"]
    assert headline.reduce_values(["unsupported"], "max") is None
    assert headline.reduce_values([], "count") == 0
    count = {"label": "f", "metric": "status", "reduce": "count", "without": {"status": "failed"},
             "with": {"status": ["wrong", "failed"], "mask": False}}
    row = headline.evaluate(recs, [count])[0]
    assert (row.without, row.with_) == (1, 0)
    # equal_to pairs by the parameters the selectors do not name (ep_size here)
    eq = {**spec, "equal_to": {"mask": False}, "equal_metric": "point"}
    row = headline.evaluate(recs, [eq])[0]
    assert row.equal is False and "differs in 2 of 2 pairs" in row.equal_detail
    eq_same = {**spec, "metric": "params.ep_size", "equal_to": {"mask": False}}
    row = headline.evaluate(recs, [eq_same])[0]
    assert row.equal is True and row.equal_detail == "equal in 2 of 2 pairs"
    none = {**spec, "equal_to": {"mask": "never"}}
    assert headline.evaluate(recs, [none])[0].equal is False
    assert "NOT EQUAL" in headline.line(headline.evaluate(recs, [none])[0])


def test_new_mask_knobs_keep_the_point_keys_of_committed_runs():
    """pcp_mask / dbo_mask at their defaults are not part of a point's key: committed runs still compare."""
    import json

    from moebench.params import Params, Point

    files = sorted(ROOT.glob("results/**/records.jsonl"))
    assert files, "no committed run to compare against"
    checked = 0
    for path in files[:3]:
        for line in path.read_text().splitlines()[:50]:
            rec = json.loads(line)
            if "key" in rec:
                assert Point(0, rec["impl"], Params(**rec["params"])).key == rec["key"], path
                checked += 1
    assert checked
    moved = Params(padding_producer="pcp", pcp_mask="local")
    assert Point(0, "x.y", moved).key != Point(0, "x.y", Params(padding_producer="pcp")).key


def test_h_padding_tax(tmp_path):
    rows, code, records = _run("padding_tax", tmp_path)
    assert code == 0 and {r["params"]["capture_sizes"] for r in records} == {"default", "dense"}
    by_list = {r["params"]["capture_sizes"]: r["info"] for r in records}
    default, dense = by_list["default"], by_list["dense"]  # the default list pads this trace as pow2 does
    # trace [3, 5, 1] on both DP ranks: default pads 3 -> 4 and 5 -> 8 (2 ranks each), 1 is a capture size
    assert [s["padded_rows"] for s in default["trace_steps"]] == [2, 6, 0]
    assert [s["padded_rows"] for s in dense["trace_steps"]] == [0, 0, 0]
    # no padded row with the dense list: no time on padding, exactly (each call is its own real-only shape)
    assert dense["headline"]["padding_us"] == {"masked": 0.0, "oblivious": 0.0}
    # exact (the scenario's trace_real_points: 0): default timed its calls (4, 3), (8, 5), (1, 1) and their real
    # tokens alone (3, 3), (5, 5), so dense's calls, all unpadded, are reused (within this run only)
    assert default["shape_mode"] == "exact" and default["timed_shapes"] == 5
    assert default["shapes_measured"] == 5 and default["shapes_reused"] == 0
    assert dense["shape_mode"] == "exact" and dense["timed_shapes"] == 3
    assert dense["shapes_measured"] == 0 and dense["shapes_reused"] == 3
    assert default["headline"]["padding_gemm_rows"]["masked"] == 0
    assert default["headline"]["jit_compiles"]["oblivious"] >= 1
    gemm = _by_prefix(rows, "expert-GEMM rows")  # the headlines name the default list, which the cpu size runs
    # repeat-filled padding copies the first real row: every padded row routes where it does, here to this rank
    assert gemm.without == default["headline"]["padding_gemm_rows"]["oblivious"] > 0 and gemm.with_ == 0
    tax = _by_prefix(rows, "padding tax, oblivious, pow2")  # pow2 is not run: said so, not a bare n/a
    assert tax.without is None and tax.with_ is not None
    assert "pow2 n/a (not in this run: no point has capture_sizes=pow2 (it has default, dense))" in headline.line(tax)


def test_i_sp_padding_prefill(tmp_path):
    """The EP step at the scenario's cpu size (the prefill-heavy trace only): every EP rank's work and the wire,
    oblivious above masked, the straggler's wait and the replay recorded; the timings are the interpreter's."""
    sweep = load_sweep(SCENARIOS / "sp_padding_prefill.yaml", FAST + ["axes.trace_distribution=[prefill_heavy]"],
                       size=SIZE)
    code, run_dir = run_sweep(sweep, out_base=tmp_path, device="cpu", out=io.StringIO())
    (rec,) = load_records(run_dir)
    assert code == 0 and rec["status"] == "ok"
    ep, head = rec["info"]["ep_step"], rec["info"]["headline"]["ep_step"]
    assert ep["wire"]["kind"] == "model" and ep["ranks_per_node"] == 2  # two nodes of 2: the NIC carries some
    assert ep["placement"].startswith("one source (DP rank x SP rank) on each of the 4 EP ranks")
    assert head["step_us"]["oblivious"] > head["step_us"]["masked"] > 0
    assert head["tax_split_us"]["wire_us"] > 0 and head["tax_split_us"]["gemm_us"] > 0
    assert set(ep["replay"]["within_tolerance"]) == {"masked", "oblivious"} and ep["replay"]["tolerance"] > 0
    assert len(ep["largest_step"]["oblivious"]["rank_us"]) == 4
    assert head["slowest_rank_padded_route_share"] is not None
