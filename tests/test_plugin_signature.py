"""A plugin whose function cannot be called as its family calls it is refused at registration, in one line naming
the missing or extra argument (not registered, then failing every point with a TypeError)."""

from __future__ import annotations

import importlib
import sys

import pytest

from moebench.cli import main
from moebench.families import all_families, call_arguments, get_family, signature_problem
from moebench.plugins import PluginError, register_kernel


def test_every_family_s_own_kernel_has_the_family_s_signature():
    """The call lines parse, and moebench's own kernel of each family (what a plugin copies) passes the check."""
    for name, family in all_families().items():
        positional, keyword = call_arguments(family.call)
        assert positional, name
        kernel = getattr(importlib.import_module(f"moebench.kernels.{name}"), name)
        assert signature_problem(family, kernel) is None, name


def _no_bias(logits, top_k, renormalize, is_padding=None, *, out=None):
    return None


def _needs_more(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None, temperature):
    return None


def _few_positional(topk_ids, *, out=None):
    return None


def _flexible(*args, **kwargs):
    return None


@pytest.mark.parametrize("family, fn, named", [
    ("topk_softmax", _no_bias, "'bias='"),
    ("topk_softmax", _needs_more, "extra argument 'temperature'"),
    ("apply_expert_map", _few_positional, "missing an argument for 'expert_map'"),
])
def test_a_wrong_signature_is_refused_naming_the_argument(family, fn, named):
    assert named in signature_problem(get_family(family), fn)
    with pytest.raises(PluginError, match=f"{family}.wrongsig: {fn.__name__} .*{named}"):
        register_kernel(family, "wrongsig", fn)


def test_a_catch_all_signature_is_accepted():
    assert signature_problem(get_family("masked_moe_sum"), _flexible) is None


PLUGIN = """
from moebench.plugins import register_kernel


def route(logits, top_k, renormalize, is_padding=None, *, out=None):
    return out


register_kernel("topk_softmax", "nobias", route)
"""

SWEEP = """name: s
target: router
plugins: [wrong_signature_plugin.py]
impls: [topk_softmax.torch]
fixed: {num_experts: 8, top_k: 2}
axes: {num_tokens: [8]}
"""


def test_a_sweep_with_a_wrong_signature_plugin_is_exit_2_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader may append the sweep's folder
    (tmp_path / "wrong_signature_plugin.py").write_text(PLUGIN)
    (tmp_path / "s.yaml").write_text(SWEEP)
    assert main(["run", str(tmp_path / "s.yaml"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "route has no argument 'bias='" in err[0], err
    assert not (tmp_path / "results").exists()
