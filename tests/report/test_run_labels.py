"""Labels from the run, not the sweep's prose: the description and plot titles from the resolved parameters, the
p50 column's meaning where it is not a kernel call, the timing mode each row was measured in, and no "vs best peer"
ratio between rows timed in different modes."""

import io
from pathlib import Path

from moebench.plots.common import constant_params
from moebench.records import timing_label
from moebench.report.describe import description_line
from moebench.report.peers import peer_footer_lines, peer_ratios
from moebench.report.table import Table, column_notes
from moebench.run.runner import run_sweep
from moebench.run.sweep import load_sweep

QUICKSTART = Path(__file__).resolve().parents[2] / "sweeps" / "quickstart.yaml"
PREFILL = "SP padding in prefill on EP 16 over two nodes: the EP step's time masked vs oblivious"


def _trace_rec(ep_size=4, source="explicit", steps=3):
    return {"impl": "serving_trace.layer", "status": "ok", "target": "serving_trace",
            "params": {"ep_size": ep_size, "ranks_per_node": 8, "dp_size": 2, "sp_size": 2, "num_experts": 32,
                       "top_k": 4, "trace_distribution": "chat", "trace_steps": 1000, "trace": [3, 5, 1]},
            "info": {"trace": {"source": source, "steps": steps}}}


def test_a_description_the_run_contradicts_is_replaced_by_the_parameters():
    sweep = {"target": "serving_trace", "description": PREFILL, "axes": {"trace_distribution": ["prefill_heavy"]}}
    text = description_line(sweep, [_trace_rec(ep_size=4)])
    assert text.startswith("serving_trace: EP 4, DP 2, SP 2, 32 experts, top_k 4, trace explicit (3 steps)")
    assert "EP 16 (the run: ep_size 4)" in text and "over two nodes (the run: 1 node)" in text
    assert description_line(sweep, [_trace_rec(ep_size=16)]) == PREFILL  # the prose holds: kept
    chat = {"target": "serving_trace", "description": "padded rows over a chat trace of 1000 steps"}
    assert "chat trace (the run: a trace from explicit)" in description_line(chat, [_trace_rec()])


def test_a_plot_title_names_the_trace_the_records_ran():
    text = constant_params([_trace_rec()], skip=(), fixed_keys=["trace_distribution", "trace_steps", "trace"])
    assert "trace=explicit (3 steps)" in text
    assert "trace_distribution" not in text and "trace_steps" not in text and "3,5,1" not in text


def test_the_header_says_what_p50_times_for_a_trace():
    out = io.StringIO()
    Table(["capture_sizes"], out=out, target="serving_trace").header()
    assert "# p50 / p10 / p90: the masked layer at the trace's most frequent call shape" in out.getvalue()
    out = io.StringIO()
    Table(["num_tokens"], out=out, target="router").header()
    assert "p50 / p10 / p90:" not in out.getvalue()


def test_the_jit_columns_n_a_is_explained_under_the_table():
    """A bare n/a in the jit column is a point whose compiles could not be counted: the footer says why."""
    interp = {"supported": False, "compiles": "unsupported",
              "reason": "TRITON_INTERPRET=1: interpreted kernels are not compiled and do not call the JIT hooks"}
    rows = [{"point": i, "status": "ok", "target": "serving_trace", "jit": interp} for i in range(2)]
    out = io.StringIO()
    table = Table(["capture_sizes"], out=out, target="serving_trace")
    table.row(rows[0])
    table.footer(rows)
    assert " n/a " in out.getvalue()
    assert ("# jit n/a: Triton JIT compiles not counted: TRITON_INTERPRET=1: interpreted kernels are not compiled"
            in out.getvalue())
    counted = {"point": 2, "status": "ok", "jit": {"supported": True, "compiles": 3}}
    (line,) = column_notes([*rows, counted, {**counted, "jit": {"supported": False}}])[:1]
    assert line.startswith("jit n/a (2 points): Triton JIT compiles not counted: TRITON_INTERPRET=1")
    assert column_notes([counted]) == []


def test_the_mode_column_is_the_mode_each_row_was_measured_in(tmp_path):
    """Under the interpreter a torch row launches no Triton kernel: `wall`, only the Triton row is `interp`; and
    their ratio is not given as a peer figure."""
    sweep = load_sweep(QUICKSTART, ["axes.num_tokens=[16]", "axes.padding_ratio=[0.0]", "axes.mask=[true]",
                                    "timing.iters=1", "timing.warmup=0"])
    _, run_dir = run_sweep(sweep, out_base=tmp_path, device="cpu", out=io.StringIO(), isolate=False)
    from moebench.records import load_records

    records = {r["impl"]: r for r in load_records(run_dir)}
    assert timing_label(records["topk_softmax.triton"]) == "interp"
    assert timing_label(records["topk_softmax.torch"]) == "wall"
    assert records["topk_softmax.torch"]["interpreted_launches"] == 0


def test_no_peer_ratio_between_timing_modes():
    def rec(impl, library, p50, launches):
        return {"point": 0, "impl": impl, "kernel": "fused_experts", "library": library, "status": "ok",
                "params": {"num_tokens": 16}, "stats": {"p50": p50}, "timing_mode": "wall", "triton_interpret": True,
                "interpreted_launches": launches}

    records = [rec("fused_experts.triton", None, 129800.0, 4), rec("fused_experts.compile", "torch.compile", 100.0, 0),
               rec("fused_experts.torch_grouped", "torch", 120.0, 0)]
    rows = {r["impl"]: r for r in peer_ratios(records)}
    assert not rows["fused_experts.triton"]["comparable"] and rows["fused_experts.torch_grouped"]["comparable"]
    text = "\n".join(peer_footer_lines(records))
    assert "interp vs wall" in text and "not given: they say nothing of a GPU" in text
    assert "1298x" not in text and "1298.000" not in text and "1.200" in text  # the torch rows keep their ratio


def test_a_record_from_before_launches_were_counted_keeps_interp():
    assert timing_label({"timing_mode": "wall", "triton_interpret": True}) == "interp"
    assert timing_label({"timing_mode": "wall", "triton_interpret": True, "interpreted_launches": 0}) == "wall"
