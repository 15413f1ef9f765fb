"""The bundled quickstart sweep, end to end: every point's router ids equal the reference's, and the padding
effect it exists to show is in the records (repeat-filled padding piles onto top_k experts unless masked)."""

from pathlib import Path

import pytest
import torch

from moebench.run.results import load_records
from moebench.run.runner import run_sweep
from moebench.run.sweep import load_sweep

QUICKSTART = Path(__file__).resolve().parents[2] / "sweeps" / "quickstart.yaml"


def _run(tmp_path, device, overrides):
    sweep = load_sweep(QUICKSTART, overrides)
    code, run_dir = run_sweep(sweep, out_base=tmp_path / "results", device=device)
    return code, load_records(run_dir)


def _check_records(records, top_k):
    assert records and all(r["status"] == "ok" for r in records), [r.get("reason") for r in records]
    for r in records:
        assert r["check"]["ok"] and r["check"]["metrics"]["ids.mismatches"] == 0, r["check"]
    by_key = {(r["impl"], r["params"]["num_tokens"], r["params"]["padding_ratio"], r["params"]["mask"]): r
              for r in records}
    for (impl, tokens, pad, mask), r in by_key.items():
        padding_routes = sum(r["imbalance"]["per_expert_padding"])
        if pad == 0 or mask:
            assert padding_routes == 0
            continue
        # unmasked repeat padding: all padded rows route identically, onto exactly top_k experts
        assert padding_routes == round(tokens * pad) * top_k
        assert sum(1 for n in r["imbalance"]["per_expert_padding"] if n) == top_k
        masked = by_key[(impl, tokens, pad, True)]
        assert r["imbalance"]["expert"]["max_over_mean"] > 2 * masked["imbalance"]["expert"]["max_over_mean"]
        # the real tokens' routing is the same with and without the mask
        assert r["imbalance"]["per_expert_real"] == masked["imbalance"]["per_expert_real"]


def test_quickstart_small_on_cpu(tmp_path):
    code, records = _run(tmp_path, "cpu", ["axes.num_tokens=[64]", "timing.iters=2", "timing.warmup=0"])
    assert code == 0
    assert len(records) == 8
    _check_records(records, top_k=4)


@pytest.mark.gpu
def test_quickstart_on_gpu_matches_reference(tmp_path):
    code, records = _run(tmp_path, "cuda", [])
    assert code == 0
    assert len(records) == 16 and all(r["timing_mode"] == "cuda_graph" for r in records)
    _check_records(records, top_k=4)
    assert torch.cuda.is_available()
