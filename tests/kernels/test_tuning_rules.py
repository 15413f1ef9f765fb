"""The rules (the launch where no tuned table has an entry) are the defaults the kernels launched before the
tuning mechanism: the pre-tables code of choose_config / choose_fp8_config, written out here literally, gives the
same launch at every shape (what keeps GPU behaviour unchanged until a table is committed); the fp8 rule has one
tier more since (>= 256 rows per expert: 128-row tiles), written into the literal code below. And every tunable's
rule names what it launches honestly: a candidate's name only where `config: <name>` launches the same, else
"rule:<label>", which no config selects."""

from __future__ import annotations

import inspect
import itertools

import pytest

from moebench.kernels import grouped_gemm
from moebench.kernels._details import experts_config, tuning
from moebench.kernels._details.align_config import align_choice
from moebench.kernels.grouped_topk import grouped_choice
from moebench.kernels.masked_moe_sum import sum_choice
from moebench.kernels.topk_softmax import softmax_choice
from moebench.kernels.fused_experts_fp8 import E4M3, Fp8ExpertsConfig, Fp8GemmConfig, fp8_choice, make_fp8_workspace
from moebench.kernels.grouped_gemm import ExpertsConfig, GemmConfig

SHAPES = list(itertools.product((1, 16, 128, 512, 4096, 8192, 65536), (1, 6, 8), (8, 32, 128, 256),
                                (256, 2048, 7168), (128, 1408, 2048)))


def _fit(block: int, dim: int) -> int:
    return max(16, min(block, 1 << max(0, (dim - 1).bit_length())))


def old_choose_config(num_routes, num_experts, hidden, intermediate) -> ExpertsConfig:
    rows_per_expert = num_routes / max(1, num_experts)
    if rows_per_expert <= 24:
        bm, up, down = 16, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 128, 8, 4, 4)
    elif rows_per_expert <= 48:
        bm, up, down = 32, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4)
    elif rows_per_expert < 128:
        bm, up, down = 64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4)
    else:
        bm, up, down = 128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True), GemmConfig(256, 64, 8, 8, 3, weight_tma=True)
    up = GemmConfig(_fit(up.block_n, intermediate), _fit(up.block_k, hidden), up.group_m, up.num_warps, up.num_stages,
                    up.weight_tma)
    down = GemmConfig(_fit(down.block_n, hidden), _fit(down.block_k, intermediate), down.group_m, down.num_warps,
                      down.num_stages, down.weight_tma)
    return ExpertsConfig(bm, up, down, reduce_block_h=_fit(1024, hidden))


def old_choose_fp8_config(num_routes, num_experts, hidden, intermediate) -> Fp8ExpertsConfig:
    rows_per_expert = num_routes / max(1, num_experts)
    if rows_per_expert <= 24:
        cfg = Fp8ExpertsConfig(16, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4))
    elif rows_per_expert <= 48:
        cfg = Fp8ExpertsConfig(32, Fp8GemmConfig(128, 8, 4, 4), Fp8GemmConfig(128, 8, 4, 4))
    elif rows_per_expert < 256:
        cfg = Fp8ExpertsConfig(64, Fp8GemmConfig(128, 8, 8, 4), Fp8GemmConfig(256, 8, 8, 4))
    else:  # the 128-row tier: the fastest from 256 rows per expert up (8 warps, rescaled accumulators)
        cfg = Fp8ExpertsConfig(128, Fp8GemmConfig(128, 8, 8, 3, rescale=True), Fp8GemmConfig(128, 8, 8, 4, act_tma=True))
    if hidden % cfg.down.block_n:
        cfg = Fp8ExpertsConfig(cfg.block_m, cfg.gate_up, Fp8GemmConfig(128, *_rest(cfg.down)), cfg.reduce_block_h)
    return Fp8ExpertsConfig(cfg.block_m, cfg.gate_up, cfg.down, min(cfg.reduce_block_h, _fit(1 << 30, hidden)))


def _rest(g: Fp8GemmConfig):
    return g.group_m, g.num_warps, g.num_stages, g.weight_tma


@pytest.fixture
def compiled(monkeypatch):
    """The GPU branch of the rules (the interpreter has a rule of its own)."""
    monkeypatch.setattr(experts_config, "interpreting", lambda: False)  # both precisions' rules live there


def test_bf16_rule_is_the_old_choose_config(compiled):
    for num_tokens, top_k, num_experts, hidden, intermediate in SHAPES:
        want = old_choose_config(num_tokens * top_k, num_experts, hidden, intermediate)
        choice = grouped_gemm.experts_choice(num_tokens, top_k, num_experts, hidden, intermediate, device="cpu")
        assert choice.source == "rule" and choice.config == want, (num_tokens, top_k, num_experts, hidden)


def test_fp8_rule_is_the_old_choose_fp8_config(compiled):
    for num_tokens, top_k, num_experts, hidden, intermediate in SHAPES:
        want = old_choose_fp8_config(num_tokens * top_k, num_experts, hidden, intermediate)
        got = fp8_choice(num_tokens, top_k, num_experts, hidden, intermediate, device="cpu").config
        assert (got.block_m, got.gate_up, got.down, got.reduce_block_h) == \
               (want.block_m, want.gate_up, want.down, want.reduce_block_h), (num_tokens, top_k, num_experts, hidden)


def test_precision_is_part_of_the_config():
    """One config type, one choice: a config of the other precision is refused, by the choice and by the launch."""
    bf16 = grouped_gemm.experts_choice(16, 2, 4, 256, 128, device="cpu", config="bm16").config
    fp8 = fp8_choice(16, 2, 4, 256, 128, device="cpu", config="bm16").config
    assert (bf16.precision, fp8.precision) == ("bf16", "fp8_block") and fp8.gate_up.block_k == 128
    with pytest.raises(ValueError, match="fp8_block config"):
        grouped_gemm.experts_choice(16, 2, 4, 256, 128, device="cpu", config=fp8)
    fp8_made = fp8_choice(16, 2, 4, 256, 128, device="cpu")
    with pytest.raises(ValueError, match="fp8_block choice, the workspace is bf16"):
        grouped_gemm.make_workspace(16, 2, 4, 256, 128, config=fp8_made, device="cpu")
    ws = make_fp8_workspace(16, 2, 4, 256, 128, device="cpu")
    assert ws.act.dtype == E4M3 and ws.act_scales.shape[1] == 1 and ws.y.dtype.itemsize == 2
    with pytest.raises(ValueError, match="made for fp8_block"):
        grouped_gemm.launch_config(ws, None, "cpu")


# The kernels whose launchers fit a named candidate to the shape (fused_experts, fused_experts_fp8) are asked through
# their own choice function; every other tunable through tuning.choose, as its launcher does. Called with the bucket's
# dims as keywords.
OWN_CHOICE = {
    "fused_experts": grouped_gemm.experts_choice,
    "fused_experts_fp8": fp8_choice,
}
# The router / sum / align choice functions are tuning.choose under the kernel's name (what the generic call checks).
THIN_CHOICE = {"masked_moe_sum": sum_choice, "moe_align_block_size": align_choice, "topk_softmax": softmax_choice,
               "grouped_topk": grouped_choice}


def choice_of(kernel: str):
    """The function the kernel's launcher chooses its launch through."""
    if kernel in OWN_CHOICE:
        return OWN_CHOICE[kernel]
    return lambda device=None, config=None, **dims: tuning.choose(kernel, device, config, **dims)


# A spread of values per shape dim (small H below every candidate's block, top_k 1, one route, huge counts).
DIM_VALUES = {
    "num_tokens": (1, 16, 128, 4096, 65536), "num_rows": (1, 6, 128, 8192, 65536),
    "num_routes": (1, 100, 8192, 524288), "top_k": (1, 2, 6, 8), "num_experts": (8, 64, 256),
    "hidden": (64, 128, 256, 512, 2048, 7168), "intermediate": (128, 1408, 2048), "num_expert_group": (1, 8),
}


def _shapes(kernel: str):
    dims = list(inspect.signature(tuning.tunable(kernel).bucket).parameters)
    for values in itertools.product(*(DIM_VALUES[d] for d in dims)):
        yield dict(zip(dims, values))


@pytest.fixture
def no_tables(tmp_path, monkeypatch):
    """No tuned table anywhere (every choice is the rule's) and no choice cached from another interpreter mode."""
    monkeypatch.setattr(tuning, "TABLES_DIR", tmp_path)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def test_tunables_are_discovered_and_their_thin_choice_functions_are_choose():
    """Every kernel with a launch table is found by walking moebench.kernels (no list); the kernels' own choice
    functions that are tuning.choose by another name choose what it chooses."""
    assert set(tuning.tunable_kernels()) >= set(OWN_CHOICE) | set(THIN_CHOICE)
    for kernel, own in THIN_CHOICE.items():
        dims = next(_shapes(kernel))
        assert own(**dims, device="cpu") == choice_of(kernel)(**dims, device="cpu"), kernel


@pytest.mark.parametrize("kernel", tuning.tunable_kernels())
@pytest.mark.parametrize("interpreted", [True, False], ids=["interpreter", "compiled"])
def test_every_rule_names_a_candidate_or_says_it_is_none(kernel, interpreted, no_tables, monkeypatch):
    monkeypatch.setattr(experts_config, "interpreting", lambda: interpreted)  # where the experts' rules look
    names = tuning.candidates(kernel)
    choose = choice_of(kernel)
    outside = 0
    for dims in _shapes(kernel):
        rule = choose(**dims, device="cpu")
        assert rule.source == "rule", (kernel, dims)
        if rule.name in names:  # a sweep's `config: <name>` launches the very same
            assert choose(**dims, device="cpu", config=rule.name).config == rule.config, (kernel, dims, rule.name)
            continue
        outside += 1
        label = rule.name[len(tuning.RULE_PREFIX):]
        assert rule.name.startswith(tuning.RULE_PREFIX) and label and label not in names, (kernel, dims, rule.name)
        assert rule.record()["config"] == rule.name
        with pytest.raises(ValueError, match="rule that is none of its candidates"):
            tuning.check_config_name(kernel, rule.name)
    if kernel in ("fused_experts", "fused_experts_fp8"):  # the interpreter's small tiles are no candidate
        assert (outside > 0) == interpreted, kernel
    if kernel == "masked_moe_sum":  # H 64..256: narrower than every candidate
        assert outside > 0
