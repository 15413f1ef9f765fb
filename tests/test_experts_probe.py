"""scripts/experts_probe.py's --config specs: a candidate with GemmConfig overrides, the other precision's names
skipped, bad input one line and exit 2 before anything runs."""

import runpy
from pathlib import Path

import pytest

PROBE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "experts_probe.py"))
parse = PROBE["parse_config"]


def test_overrides_reach_the_gemm_configs():
    cfg = parse("bm128_tma:down.act_tma=1,both.num_stages=4,up.one_dot=1", "bf16")
    assert cfg.down.act_tma and not cfg.gate_up.act_tma and cfg.gate_up.one_dot
    assert (cfg.gate_up.num_stages, cfg.down.num_stages, cfg.block_m) == (4, 4, 128)
    assert parse("bm128_w8r", "fp8_block").gate_up.rescale
    assert parse("bm128_w8r", "bf16") is None  # another precision's candidate: skipped


@pytest.mark.parametrize("spec,says", [
    ("nope", "in neither candidate table"), ("bm16:x.y=1", "expected <field>"),
    ("bm16:up.flatten=yes", "expected an integer"), ("bm16:up.foo=1", "unexpected keyword"),
    ("bm16:down.rescale=1", "fp8 gate/up GEMM only")])
def test_bad_specs_are_one_line_and_exit_2(capsys, spec, says):
    with pytest.raises(SystemExit) as e:
        parse(spec, "bf16")
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("experts_probe.py: --config") and says in line
