"""The EP wire model (moebench.dispatch.wire_model): phase times on hand-built byte matrices, payload row sizes,
calibration from a dispatch run (synthetic, and the committed 2 x H200 run the defaults come from), and every
refusal, in the library and through the CLI (--dry-run: exit 2, one line, nothing written)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from moebench.bench.serving_trace.wire import wire_model_of
from moebench.cli import main
from moebench.dispatch.wire_model import (
    DEFAULT_CALIBRATION_RUN,
    DEFAULT_WIRE_MODEL,
    INTER_NODE_DEFAULT,
    LinkModel,
    WireCalibrationError,
    WireModel,
    calibrate,
    combine_row_bytes,
    dispatch_row_bytes,
)
from moebench.params import Params, Point

REPO = Path(__file__).resolve().parents[2]
GB = 1e3  # bytes per us at 1 GB/s


def _model(intra=(100.0, 2.0), inter=(10.0, 5.0), per_node=2, d_over=7.0, c_over=3.0) -> WireModel:
    return WireModel("t", LinkModel(*intra), LinkModel(*inter), per_node, d_over, c_over)


# ---------------------------------------------------------------------------------------------------------------
# phase_us on hand-built matrices
# ---------------------------------------------------------------------------------------------------------------

def test_one_node_each_rank_its_larger_direction_the_diagonal_ignored():
    m = _model(per_node=4)
    mb = 1e6
    bytes_matrix = [[9e9, 2 * mb, 0, 0],  # rank 0: out 2 MB, in 1 MB (its own 9 GB never on a wire)
                    [1 * mb, 0, 0, 3 * mb],  # rank 1: out 4 MB, in 2 MB
                    [0, 0, 5e9, 0],  # rank 2: no traffic at all
                    [0, 1 * mb, 0, 0]]  # rank 3: out 1 MB, in 3 MB
    t = m.phase_us(bytes_matrix)
    bw = 100.0 * GB
    assert t.rank_us == (2.0 + 2 * mb / bw, 2.0 + 4 * mb / bw, 0.0, 2.0 + 3 * mb / bw)
    assert t.slowest_rank == 1 and t.overhead_us == 0.0 and t.us == 2.0 + 40.0
    assert t.intra_bytes == 7 * mb and t.inter_bytes == 0
    d, c = m.dispatch_us(bytes_matrix), m.combine_us(bytes_matrix)
    assert d.us == 7.0 + 42.0 and d.overhead_us == 7.0 and c.us == 3.0 + 42.0


def test_two_nodes_the_nic_is_the_bottleneck():
    m = _model(intra=(400.0, 1.0), inter=(50.0, 10.0), per_node=2)
    mb = 1e6
    # ranks 0, 1 on node 0; ranks 2, 3 on node 1
    bytes_matrix = [[0, 8 * mb, 1 * mb, 0],
                    [8 * mb, 0, 0, 2 * mb],
                    [0, 0, 0, 0],
                    [0, 0, 0, 0]]
    t = m.phase_us(bytes_matrix)
    intra = 1.0 + 8 * mb / (400 * GB)  # 21 us
    assert t.rank_us[0] == max(intra, 10.0 + 1 * mb / (50 * GB))  # NIC 30 us
    assert t.rank_us[1] == max(intra, 10.0 + 2 * mb / (50 * GB))  # NIC 50 us: the slowest
    assert t.rank_us[2] == 10.0 + 1 * mb / (50 * GB) and t.rank_us[3] == 10.0 + 2 * mb / (50 * GB)
    assert t.slowest_rank == 1 and t.us == 50.0
    assert t.intra_bytes == 16 * mb and t.inter_bytes == 3 * mb
    # the same traffic on one node of 4: NVLink carries all of it
    assert _model(intra=(400.0, 1.0), inter=(50.0, 10.0), per_node=4).phase_us(bytes_matrix).us == 1.0 + 10 * mb / (400 * GB)


def test_a_matrix_without_off_rank_traffic_is_the_overhead_alone_and_arrays_are_taken():
    m = _model()
    assert m.dispatch_us([[5.0, 0.0], [0.0, 5.0]]).us == 7.0
    assert m.phase_us([]).us == 0.0
    np = pytest.importorskip("numpy")
    assert m.phase_us(np.array([[0, 1e6], [0, 0]])).us == m.phase_us([[0, 1e6], [0, 0]]).us


@pytest.mark.parametrize("bad", [[[0, 1], [1]], [[0, -1], [0, 0]], [[0, math.nan], [0, 0]]],
                         ids=["not square", "negative", "nan"])
def test_a_bad_matrix_is_refused(bad):
    with pytest.raises(ValueError, match="bytes_matrix: row"):
        _model().phase_us(bad)


def test_figures_out_of_range_are_refused():
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        LinkModel(0.0, 1.0)
    with pytest.raises(ValueError, match="latency_us"):
        LinkModel(1.0, -1.0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        _model(per_node=0)


# ---------------------------------------------------------------------------------------------------------------
# Payload sizes
# ---------------------------------------------------------------------------------------------------------------

def test_row_bytes():
    assert dispatch_row_bytes(7168, 8) == 14400  # what the dispatch paths record (dispatch_payload_bytes / rows)
    assert dispatch_row_bytes(7168, 8, "fp8") == 7168 + 56 * 4 + 64
    assert dispatch_row_bytes(200, 2, "fp8") == 200 + 2 * 4 + 16  # a partial 128-wide block has its own scale
    assert combine_row_bytes(7168) == 14336
    with pytest.raises(ValueError, match="payload_dtype"):
        dispatch_row_bytes(7168, 8, "fp16")


def test_committed_run_counts_bf16_rows_as_dispatch_row_bytes():
    for line in (REPO / DEFAULT_CALIBRATION_RUN / "records.jsonl").read_text().splitlines()[:4]:
        rec = json.loads(line)
        info, p = rec["info"], rec["params"]
        assert info["dispatch_payload_bytes"] == info["recv_rows"] * dispatch_row_bytes(p["hidden"], p["top_k"])


# ---------------------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------------------

def _linear(offs, bw, d0, c0, H=64, K=2):
    """Points whose phase times are exactly d0 / c0 + off-rank bytes / bw."""
    row, crow = dispatch_row_bytes(H, K), combine_row_bytes(H)
    return [(n, d0 + n * row / (bw * GB), c0 + n * crow / (bw * GB), 2) for n in offs]


def _write_run(run: Path, points, *, target="dispatch", device="cuda", gpus=2, impl="dispatch.a2a", H=64, K=2):
    """A dispatch run of `points` = [(rows_off_rank, dispatch_us, combine_us, ep_size)], rank 0's view."""
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"device": device, "env": {"gpu_count": gpus},
                                                   "sweep": {"name": "d", "target": target}}))
    row = dispatch_row_bytes(H, K)
    lines = []
    for i, (off, d_us, c_us, ep) in enumerate(points):
        own = 5
        info = {"rows_sent_per_dest": [own, off], "rows_recv_per_src": [own, off], "recv_rows": own + off,
                "recv_rows_own": own, "dispatch_payload_bytes": (own + off) * row,
                "combine_payload_bytes": (own + off) * combine_row_bytes(H)}
        lines.append(json.dumps({"point": i, "impl": impl, "status": "ok", "params": {"ep_size": ep, "hidden": H},
                                 "info": info, "stages": {"dispatch": {"p50": d_us}, "combine": {"p50": c_us}}}))
    lines.append(json.dumps({"point": 99, "impl": impl, "status": "failed", "params": {"ep_size": 2}}))
    (run / "records.jsonl").write_text("\n".join(lines) + "\n")
    return row


def test_calibrate_recovers_a_known_link_and_intercepts(tmp_path):
    bw, d0, c0 = 200.0, 50.0, 30.0
    row, crow = dispatch_row_bytes(64, 2), combine_row_bytes(64)
    offs = [100, 1000, 4000, 9000, 20000]
    wobble = [1.004, 0.997, 1.002, 0.999, 1.001]
    pts = [(n, (d0 + n * row / (bw * GB)) * w, (c0 + n * crow / (bw * GB)) / w, 2) for n, w in zip(offs, wobble)]
    pts.append((20000, 1e6, 1e6, 4))  # an EP group bigger than the host: left out
    _write_run(tmp_path / "run", pts)
    m = calibrate(tmp_path / "run")
    assert m.intra.bandwidth_gbps == pytest.approx(bw, rel=0.01)
    assert m.dispatch_overhead_us == pytest.approx(d0, rel=0.01)
    assert m.combine_overhead_us == pytest.approx(c0, rel=0.01)
    assert m.intra.latency_us == 0.0 and m.inter == INTER_NODE_DEFAULT and m.ranks_per_node == 2
    assert m.source["intra.bandwidth_gbps"] == f"calibrated: {tmp_path / 'run'}, 5 points, dispatch.a2a"
    assert "no link between nodes" in m.source["inter.bandwidth_gbps"]
    rec = m.record()
    assert rec["kind"] == "model" and json.loads(json.dumps(rec)) == rec


def test_a_negative_intercept_is_held_at_zero(tmp_path):
    row, crow = dispatch_row_bytes(64, 2), combine_row_bytes(64)
    pts = [(n, 40.0 + n * row / (100 * GB), n * crow / (100 * GB) - 20.0, 2) for n in (100_000, 200_000, 400_000, 800_000)]
    _write_run(tmp_path / "run", pts)
    m = calibrate(tmp_path / "run")
    assert m.combine_overhead_us == 0.0 and m.dispatch_overhead_us > 0


def test_calibrate_on_the_committed_run_gives_the_defaults():
    m = calibrate(REPO / DEFAULT_CALIBRATION_RUN)
    d = DEFAULT_WIRE_MODEL
    assert round(m.intra.bandwidth_gbps) == d.intra.bandwidth_gbps
    assert (round(m.dispatch_overhead_us), round(m.combine_overhead_us)) == (d.dispatch_overhead_us,
                                                                             d.combine_overhead_us)
    assert m.intra.latency_us == d.intra.latency_us and m.inter == d.inter
    assert m.ranks_per_node == 2 and d.ranks_per_node == 8


@pytest.mark.parametrize("case,message", [
    ("missing", "no such run directory"),
    ("not a run", "not a moebench run (no manifest.json)"),
    ("bad manifest", "manifest.json: not readable as JSON"),
    ("bad records", "records.jsonl: not readable"),
    ("layer run", "target 'layer' is not dispatch"),
    ("cpu run", "not a run on 2 or more GPUs"),
    ("too few points", "2 usable ok points of dispatch.a2a (ep_size 2..2), the fit needs 3"),
    ("other path", "0 usable ok points of dispatch.agrs"),
    ("one byte count", "no byte count differs between the points"),
    ("faster with bytes", "no positive bandwidth"),
])
def test_calibrate_refuses(tmp_path, case, message):
    run = tmp_path / "run"
    path = "dispatch.a2a"
    if case == "not a run":
        run.mkdir()
    elif case == "bad manifest":
        _write_run(run, [(1, 1, 1, 2)] * 3)
        (run / "manifest.json").write_text("{not json")
    elif case == "bad records":
        _write_run(run, [(1, 1, 1, 2)] * 3)
        (run / "records.jsonl").write_bytes(b"\xff\xfe\n")
    elif case == "layer run":
        _write_run(run, [(1, 1, 1, 2)] * 3, target="layer")
    elif case == "cpu run":
        _write_run(run, [(1, 1, 1, 2)] * 3, device="cpu", gpus=0)
    elif case == "too few points":
        _write_run(run, [(1, 1, 1, 2), (2, 2, 2, 2)])
    elif case == "other path":
        _write_run(run, [(1, 1, 1, 2)] * 3)
        path = "dispatch.agrs"
    elif case == "one byte count":
        _write_run(run, [(7, 1, 1, 2), (7, 2, 2, 2), (7, 3, 3, 2)])
    elif case == "faster with bytes":
        _write_run(run, [(10, 300, 300, 2), (100, 200, 200, 2), (1000, 100, 100, 2)])
    with pytest.raises(WireCalibrationError) as e:
        calibrate(run, path)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1 and str(e.value).startswith(str(run))


# ---------------------------------------------------------------------------------------------------------------
# wire_model_of: defaults <- calibration <- sweep keys
# ---------------------------------------------------------------------------------------------------------------

def test_wire_model_of_layers_the_sources(tmp_path):
    assert wire_model_of(Params()) == DEFAULT_WIRE_MODEL
    _write_run(tmp_path / "run", _linear((10, 20, 40), 50.0, 10.0, 5.0))
    p = replace(Params(), dispatch_calibration=str(tmp_path / "run"), wire_inter_gbps=25.0, ranks_per_node=4)
    m = wire_model_of(p)
    assert m.name.startswith("calibrated:") and m.inter.bandwidth_gbps == 25.0 and m.ranks_per_node == 4
    assert m.inter.latency_us == INTER_NODE_DEFAULT.latency_us
    assert m.intra.bandwidth_gbps == pytest.approx(50.0) and m.dispatch_overhead_us == pytest.approx(10.0)
    assert m.source["inter.bandwidth_gbps"] == "sweep key wire_inter_gbps"
    assert m.source["ranks_per_node"] == "sweep key ranks_per_node"
    assert m.source["intra.bandwidth_gbps"].startswith("calibrated: ")
    keys = wire_model_of(replace(Params(), wire_intra_gbps=100.0, wire_intra_latency_us=3.0,
                                 wire_inter_latency_us=1.0))
    assert keys.intra == LinkModel(100.0, 3.0) and keys.inter == LinkModel(43.0, 1.0)
    assert keys.source["intra.latency_us"] == "sweep key wire_intra_latency_us"
    with pytest.raises(ValueError, match="wire_path"):
        wire_model_of(replace(Params(), wire_path="dispatch.agrs"))


def test_new_keys_at_their_defaults_keep_point_keys():
    assert Point(0, "x.y", Params()).key == "ab12107a688a05a6"  # the key before the wire keys existed
    assert Point(0, "x.y", replace(Params(), ranks_per_node=16)).key != Point(0, "x.y", Params()).key


# ---------------------------------------------------------------------------------------------------------------
# The sweep keys through the CLI
# ---------------------------------------------------------------------------------------------------------------

SWEEP = """\
name: w
target: router
impls: [topk_softmax.torch]
fixed: {{num_experts: 16, top_k: 2, num_tokens: 8, {extra}}}
timing: {{warmup: 0, iters: 1}}
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _dry_run(tmp_path, capsys, monkeypatch, extra, cwd=None):
    monkeypatch.chdir(cwd or tmp_path)
    (tmp_path / "sweeps").mkdir(exist_ok=True)
    sweep = tmp_path / "sweeps" / "s.yaml"
    sweep.write_text(SWEEP.format(extra=extra))
    before = _files(tmp_path)
    code = main(["run", str(sweep), "--dry-run", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert _files(tmp_path) == before
    return code, out, err.strip().splitlines()


@pytest.mark.parametrize("extra,message", [
    ("wire_intra_gbps: 0", "fixed.wire_intra_gbps: must be > 0 GB/s, got 0"),
    ("wire_inter_gbps: -5.0", "fixed.wire_inter_gbps: must be > 0 GB/s, got -5.0"),
    ("wire_intra_latency_us: -1", "fixed.wire_intra_latency_us: must be >= 0 us, got -1"),
    ("wire_inter_latency_us: -0.5", "fixed.wire_inter_latency_us: must be >= 0 us, got -0.5"),
    ("ranks_per_node: 0", "fixed.ranks_per_node: must be >= 1, got 0"),
    ("ranks_per_node: 3, ep_size: 4", "fixed.ranks_per_node: 3 does not divide ep_size 4"),
    ("wire_path: dispatch.agrs", "fixed.wire_path: 'dispatch.agrs' needs dispatch_calibration"),
    ("dispatch_calibration: no_such_run", "fixed.dispatch_calibration: no_such_run: no such directory"),
    ("dispatch_calibration: notarun", "notarun: not a moebench run (no manifest.json)"),
    ("dispatch_calibration: layerrun", "layerrun/manifest.json: target 'layer' is not dispatch"),
])
def test_bad_wire_keys_are_refused(tmp_path, capsys, monkeypatch, extra, message):
    (tmp_path / "notarun").mkdir()
    _write_run(tmp_path / "layerrun", [(1, 1, 1, 2)] * 3, target="layer")
    code, out, err = _dry_run(tmp_path, capsys, monkeypatch, extra)
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"moebench: error: {tmp_path / 'sweeps' / 's.yaml'}: ") and message in err[0], err[0]


def test_calibration_resolves_beside_the_sweep_then_the_current_directory(tmp_path, capsys, monkeypatch):
    pts = _linear((10, 20, 40), 50.0, 10.0, 5.0)
    _write_run(tmp_path / "sweeps" / "beside", pts)
    code, out, err = _dry_run(tmp_path, capsys, monkeypatch, "dispatch_calibration: beside, ranks_per_node: 4, "
                                                             "ep_size: 8, wire_intra_gbps: 300.0")
    assert code == 0, err
    _write_run(tmp_path / "here", pts)  # the current directory, not beside the sweep
    code, out, err = _dry_run(tmp_path, capsys, monkeypatch, "dispatch_calibration: here")
    assert code == 0, err
    from moebench.run.sweep import load_sweep

    monkeypatch.chdir(tmp_path)
    stored = load_sweep(tmp_path / "sweeps" / "s.yaml").fixed["dispatch_calibration"]
    assert stored == str((tmp_path / "here").resolve())  # absolute: a resume from elsewhere still finds it
