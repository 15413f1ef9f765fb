"""Model presets: `model: NAME` under a sweep's `fixed` fills the MoE layer's shape from a model's public config.

Each entry cites the config file it was read from and maps its fields onto moebench's parameters:
num_experts (n_routed_experts / num_experts / num_local_experts), top_k (num_experts_per_tok /
experts_per_token), hidden (hidden_size), intermediate (moe_intermediate_size, or intermediate_size for models
whose experts use it), num_expert_group / topk_group (n_group / topk_group; 1 when the model routes without
groups), scoring (scoring_func; softmax where the config names none), bias (the selection-only expert bias of
`noaux_tc` routing: e_score_correction_bias), renormalize (norm_topk_prob, or a softmax taken over the selected
logits, which is the same thing), routed_scaling_factor. Keys the sweep sets explicitly override the preset.
Shared experts and dense layers are outside moebench's routed-expert layer and are not represented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRESET_KEYS = ("num_experts", "top_k", "hidden", "intermediate", "num_expert_group", "topk_group", "scoring",
               "bias", "renormalize", "routed_scaling_factor")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    source: str  # the public config the numbers come from
    values: dict[str, Any]
    note: str = ""  # where moebench's parameters cannot express the model exactly
    aliases: tuple[str, ...] = field(default=())


def _p(num_experts, top_k, hidden, intermediate, scoring="softmax", bias=False, renormalize=True,
       routed_scaling_factor=1.0, num_expert_group=1, topk_group=1) -> dict[str, Any]:
    return dict(num_experts=num_experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                num_expert_group=num_expert_group, topk_group=topk_group, scoring=scoring, bias=bias,
                renormalize=renormalize, routed_scaling_factor=routed_scaling_factor)


_HF = "https://huggingface.co/{}/blob/main/config.json"

PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("deepseek-v3", _HF.format("deepseek-ai/DeepSeek-V3"),
                _p(256, 8, 7168, 2048, "sigmoid", True, True, 2.5, 8, 4),
                aliases=("deepseek-r1",)),
    ModelPreset("deepseek-v4", _HF.format("deepseek-ai/DeepSeek-V4-Flash"),
                _p(256, 6, 4096, 2048, "sigmoid", True, True, 1.0),
                note="DeepSeek-V4-Flash. Its router scores with sqrtsoftplus, which moebench does not implement: "
                     "sigmoid (also monotone, so the same experts are selected without bias) stands in; the "
                     "routed_scaling_factor is left at 1.0; its first layers route by token hash, not modelled",
                aliases=("deepseek-v4-flash",)),
    ModelPreset("kimi-k2", _HF.format("moonshotai/Kimi-K2-Instruct"),
                _p(384, 8, 7168, 2048, "sigmoid", True, True, 2.827)),
    ModelPreset("qwen3-235b-a22b", _HF.format("Qwen/Qwen3-235B-A22B"), _p(128, 8, 4096, 1536)),
    ModelPreset("qwen3-30b-a3b", _HF.format("Qwen/Qwen3-30B-A3B"), _p(128, 8, 2048, 768)),
    ModelPreset("gpt-oss-120b", _HF.format("openai/gpt-oss-120b"), _p(128, 4, 2880, 2880),
                note="the router takes a softmax over the top-k logits: softmax selection + renormalize"),
    ModelPreset("gpt-oss-20b", _HF.format("openai/gpt-oss-20b"), _p(32, 4, 2880, 2880),
                note="the router takes a softmax over the top-k logits: softmax selection + renormalize"),
    ModelPreset("mixtral-8x7b", _HF.format("mistralai/Mixtral-8x7B-v0.1"), _p(8, 2, 4096, 14336)),
    ModelPreset("llama4-maverick", _HF.format("meta-llama/Llama-4-Maverick-17B-128E-Instruct"),
                _p(128, 1, 5120, 8192, "sigmoid", False, False),
                note="top-1 on the logits, then a sigmoid of the chosen one: sigmoid scoring, no renormalisation; "
                     "the shared expert and the dense layers are not modelled"),
    ModelPreset("glm-4.5", _HF.format("zai-org/GLM-4.5"), _p(160, 8, 5120, 1536, "sigmoid", True, True, 2.5)),
)}

_BY_ALIAS = {a: p.name for p in PRESETS.values() for a in p.aliases}


class UnknownModel(KeyError):
    def __str__(self) -> str:  # KeyError quotes its argument; the message is the point here
        return str(self.args[0])


def get_preset(name: str) -> ModelPreset:
    key = _BY_ALIAS.get(name, name)
    if key not in PRESETS:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def apply_preset(fixed: dict[str, Any], explicit: set[str] | None = None) -> dict[str, Any]:
    """`fixed` with its `model` entry replaced by the preset's values; keys in `explicit` (default: every other key
    of `fixed`) keep their explicit values. The model name stays recorded under `model`."""
    if "model" not in fixed:
        return dict(fixed)
    preset = get_preset(str(fixed["model"]))
    explicit = set(fixed) - {"model"} if explicit is None else explicit
    out = {k: v for k, v in preset.values.items() if k not in explicit}
    out.update(fixed)
    out["model"] = preset.name
    return out


def overridden(model: str, explicit: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, the preset's value, the given value) for each key of `explicit` (a sweep's own fixed values or axis
    lists) that overrides a different value of the preset `model`."""
    values = get_preset(model).values
    return [(k, values[k], v) for k, v in explicit.items()
            if k in values and (v != values[k] if not isinstance(v, list) else v != [values[k]])]


def override_notices(fixed: dict[str, Any], axes: dict[str, Any]) -> list[str]:
    """One line per model preset (`model` in a sweep's fixed values or axes) whose values the sweep's explicit keys
    override (which keys, the preset's value -> the given one): the sweep runs with the given values, and says so."""
    models = axes.get("model") or [fixed.get("model")]
    explicit = {k: v for k, v in {**fixed, **axes}.items() if k != "model"}
    lines = []
    for model in dict.fromkeys(m for m in models if m is not None):
        changes = overridden(model, explicit)
        if changes:
            shown = ", ".join(f"{k} {_shown(preset)} -> {_shown(given)}" for k, preset, given in changes)
            lines.append(f"model {model}: {shown} (set explicitly in the sweep or by --set: they override the "
                         "preset)")
    return lines


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe() -> list[tuple[str, str, str]]:
    """(name, shape summary, source) per preset, for `moebench list --models`."""
    rows = []
    for p in PRESETS.values():
        v = p.values
        groups = f" groups {v['num_expert_group']}/{v['topk_group']}" if v["num_expert_group"] > 1 else ""
        shape = (f"E={v['num_experts']} top_k={v['top_k']} H={v['hidden']} I={v['intermediate']} "
                 f"{v['scoring']}{' +bias' if v['bias'] else ''}{groups}"
                 f"{' renorm' if v['renormalize'] else ''} scale={v['routed_scaling_factor']}")
        rows.append((p.name, shape, p.source + (f" ({p.note})" if p.note else "")))
    return rows
