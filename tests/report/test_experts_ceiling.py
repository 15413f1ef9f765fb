"""The GEMM ceiling beside fused_experts: the ceiling impls (bench/experts_ceiling.py) build and check on the CPU
(bf16 on torch's CPU _grouped_mm, fp8 through the plain-torch loop of _scaled_grouped_mm), a wrong GEMM fails the
check, and report/ceiling.py pairs every record with the ceiling of its expert dtype at its point (table footer,
report page), while the peer ratios leave the ceilings out."""

from __future__ import annotations

import dataclasses
import io
import json

import torch

from moebench import registry
from moebench.bench.experts_ceiling import build_ceiling, group_sizes, sorted_tokens
from moebench.bench.torch_grouped_gemm import LOOP_GEMMS, GroupedGemms, grouped_mm_loop
from moebench.params import Params
from moebench.registry import RunContext
from moebench.report.ceiling import ceiling_footer_lines, ceiling_rows
from moebench.report.page import write_report
from moebench.report.peers import peer_ratios
from moebench.report.table import Table

CPU = RunContext(device=torch.device("cpu"))
SMALL = dict(num_tokens=16, num_experts=8, num_local_experts=4, top_k=3, hidden=64, intermediate=32,
             padding_ratio=0.25, padding_fill="repeat")
SMALL_FP8 = dict(SMALL, hidden=256, intermediate=128, group_size=32, scale_format="ue8m0_packed")
NAMES = ("fused_experts.ceiling", "fused_experts.ceiling_equal",
         "fused_experts.fp8_ceiling", "fused_experts.fp8_ceiling_equal")


def test_group_sizes_are_the_valid_routes_and_equal_groups_keep_their_total():
    ids = torch.tensor([[0, 2, -1], [2, 5, 1], [2, -1, 0]], dtype=torch.int32)  # 5 >= E=4: skipped
    assert group_sizes(ids, 4, "routed").tolist() == [2, 1, 3, 0]
    assert group_sizes(ids, 4, "equal").tolist() == [2, 2, 1, 1]
    assert sorted_tokens(ids, 4).tolist()[:6] == [0, 2, 1, 0, 1, 2]  # expert order, stable; skipped last


def test_ceilings_are_registered_as_ceilings_not_peers():
    for name in NAMES:
        impl = registry.get(name)
        assert impl.ceiling and impl.library is None and not impl.baseline, name


def test_ceiling_cases_check_on_the_cpu():
    p = dataclasses.replace(Params(), **SMALL)
    for groups in ("routed", "equal"):
        assert registry.get(NAMES[0 if groups == "routed" else 1]).available(CPU) is None
        case = build_ceiling("bf16", groups)(p, CPU)
        res = case.check()
        assert res.ok, (groups, res.detail)
        assert res.metrics["gate_up.rows_checked"] == case.info["rows"] > 0
        assert case.info["groups"] == groups and case.info["expert_dtype"] == "bf16" and case.flops > 0
        assert (case.routing is None) == (groups == "equal")
        tiles = case.info["row_tiles"]["64"]
        assert tiles["tiles"] >= -(-case.info["rows"] // 64)
        if groups == "equal":  # the equal ceiling's own groups are the equal split
            assert tiles["tiles"] == tiles["equal_tiles"]
    p8 = dataclasses.replace(Params(), **SMALL_FP8)
    assert "CUDA" in registry.get(NAMES[2]).available(CPU)
    case = build_ceiling("fp8", "routed", LOOP_GEMMS)(p8, CPU)
    res = case.check()
    assert res.ok, res.detail
    assert case.info["expert_dtype"] == "fp8" and case.roofline_us > 0


def test_a_gemm_that_takes_the_wrong_expert_fails_the_ceiling_check():
    wrong = GroupedGemms(lambda a, b, *, offs: grouped_mm_loop(a, b.flip(0), offs=offs), LOOP_GEMMS.scaled_grouped_mm,
                         "experts reversed")
    res = build_ceiling("bf16", "routed", wrong)(dataclasses.replace(Params(), **SMALL), CPU).check()
    assert not res.ok and "gate_up" in res.detail


def _rec(point, impl, p50, dtype, ceiling=False, groups=None, **params):
    info = {"expert_dtype": dtype, **({"groups": groups} if groups else {})}
    return {"point": point, "impl": impl, "kernel": "fused_experts", "library": "torch" if "grouped_mm" in impl
            and not ceiling else None, "ceiling": ceiling, "status": "ok", "info": info,
            "params": {"num_tokens": 4096, **params}, "stats": {"p50": p50, "p10": p50, "p90": p50}}


RECORDS = [_rec(0, "fused_experts.triton", 6580.0, "bf16"), _rec(1, "fused_experts.grouped_mm", 7832.0, "bf16"),
           _rec(2, "fused_experts.fp8", 5130.0, "fp8"),
           _rec(3, "fused_experts.ceiling", 6575.0, "bf16", True, "routed"),
           _rec(4, "fused_experts.ceiling_equal", 4758.0, "bf16", True, "equal"),
           _rec(5, "fused_experts.triton", 11000.0, "bf16", num_tokens=8192)]  # no ceiling at that point


def test_records_get_their_fraction_of_the_ceiling_of_their_dtype_at_their_point():
    rows = {r["impl"]: r for r in ceiling_rows(RECORDS)}
    assert set(rows) == {"fused_experts.triton", "fused_experts.grouped_mm"}  # fp8: no fp8 ceiling in this run
    t = rows["fused_experts.triton"]
    assert t["ceiling_us"] == 6575.0 and t["ceiling_equal_us"] == 4758.0
    assert abs(t["fraction_of_ceiling"] - 6575.0 / 6580.0) < 1e-12 and abs(t["uneven_cost"] - 6575 / 4758) < 1e-12
    assert rows["fused_experts.grouped_mm"]["point"] == 1
    assert not any(r["impl"].startswith("fused_experts.ceiling") for r in peer_ratios(RECORDS))


def test_table_footer_and_report_page_show_the_fraction(tmp_path):
    out = io.StringIO()
    Table(["num_tokens"], out=out).footer(RECORDS)
    text = out.getvalue()
    assert "vs the GEMM ceiling" in text and "0.999" in text and "1.382" in text
    assert ceiling_footer_lines(RECORDS[:3]) == []  # no ceiling timed: no block
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    page = write_report([run], tmp_path / "r.md").read_text()
    assert "### The GEMM ceiling" in page and "| of ceiling |" in page and "| 0.840 |" in page


def test_layer_ceiling_follows_the_points_expert_dtype_and_pairs_with_the_layer_records():
    impl = registry.get("layer.ceiling")
    assert impl.ceiling and impl.targets == ("layer",) and "CUDA" in impl.available(CPU)  # it needs both GEMMs
    p = dataclasses.replace(Params(), **SMALL, expert_dtype="bf16")
    case = impl.build(p, CPU)  # the bf16 GEMM runs on the CPU
    assert case.check().ok and case.info["expert_dtype"] == "bf16"
    assert "128" in impl.validate(dataclasses.replace(p, expert_dtype="fp8"))
    recs = [dict(_rec(0, "layer.masked", 7000.0, "fp8"), kernel="layer", stages={"experts": {"p50": 5600.0}}),
            dict(_rec(1, "layer.ceiling", 5000.0, "fp8", True, "routed"), kernel="layer")]
    (row,) = ceiling_rows(recs)
    assert row["impl"] == "layer.masked" and abs(row["experts_stage_fraction"] - 5000 / 5600) < 1e-12
    assert row["ceiling_equal_us"] is None and row["uneven_cost"] is None
