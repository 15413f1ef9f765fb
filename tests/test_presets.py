"""Model presets: `model: NAME` under fixed (or as an axis, or --set fixed.model=NAME) fills the layer's shape from
the bundled table; explicit keys override it; an unknown name is one line listing the known ones."""

from __future__ import annotations

import pytest

from moebench.cli import main
from moebench.params import Params, Point
from moebench.presets import PRESETS, PRESET_KEYS
from moebench.run.sweep import SweepError, expand, load_sweep, sweep_from_dict


def _sweep(fixed=None, axes=None, impls=("grouped_topk.torch",)):
    return sweep_from_dict({"name": "m", "target": "router", "impls": list(impls), "fixed": fixed or {},
                            "axes": axes or {"num_tokens": [8]}})


def test_deepseek_v3_preset_fills_the_router_shape():
    (pt,) = expand(_sweep({"model": "deepseek-v3"}))
    p = pt.params
    assert (p.num_experts, p.top_k, p.num_expert_group, p.topk_group, p.scoring) == (256, 8, 8, 4, "sigmoid")
    assert p.bias and p.renormalize and p.routed_scaling_factor == 2.5
    assert (p.hidden, p.intermediate) == (7168, 2048)
    assert p.model == "deepseek-v3"  # recorded in the params


def test_explicit_keys_override_the_preset_in_fixed_and_axes():
    pts = expand(_sweep({"model": "deepseek-v3", "top_k": 4}, {"num_experts": [64, 128]}))
    assert [(p.params.num_experts, p.params.top_k, p.params.num_expert_group) for p in pts] == \
        [(64, 4, 8), (128, 4, 8)]


def test_model_as_an_axis():
    pts = expand(_sweep(axes={"model": ["qwen3-30b-a3b", "mixtral-8x7b"]}, impls=("topk_softmax.torch",)))
    assert [(p.params.model, p.params.num_experts, p.params.top_k) for p in pts] == \
        [("qwen3-30b-a3b", 128, 8), ("mixtral-8x7b", 8, 2)]


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(SweepError) as e:
        _sweep({"model": "gpt-5"})
    msg = str(e.value)
    assert "fixed.model" in msg and "gpt-5" in msg and "deepseek-v3" in msg and "\n" not in msg


def test_set_fixed_model_on_the_command_line(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: s\ntarget: router\nimpls: [topk_softmax.torch]\naxes: {num_tokens: [8]}\n")
    (pt,) = expand(load_sweep(f, ["fixed.model=kimi-k2", "fixed.scoring=softmax", "fixed.bias=false",
                                  "fixed.num_expert_group=1", "fixed.topk_group=1"]))
    assert (pt.params.num_experts, pt.params.top_k, pt.params.model) == (384, 8, "kimi-k2")


def test_every_preset_is_a_valid_point_and_cites_its_config():
    required = {"deepseek-v3", "deepseek-v4", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b", "gpt-oss-120b",
                "gpt-oss-20b", "mixtral-8x7b", "llama4-maverick", "glm-4.5"}
    assert required <= set(PRESETS)
    for name, preset in PRESETS.items():
        assert set(preset.values) == set(PRESET_KEYS)
        assert preset.source.startswith("https://")
        (pt,) = expand(_sweep({"model": name}, impls=("topk_softmax.torch",)))
        assert pt.params.model == name


def test_point_keys_unchanged_without_a_model():
    p = Params()
    assert Point(0, "x.y", p).key == "ab12107a688a05a6"  # the defaults' key since the first runs
    assert Point(0, "x.y", p).key != Point(0, "x.y", Params(model="deepseek-v3")).key


def test_list_models_prints_the_table(capsys):
    assert main(["list", "--models"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3" in out and "E=256 top_k=8" in out and "huggingface.co" in out
