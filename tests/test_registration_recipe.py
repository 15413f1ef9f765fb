"""The recipe of docs/architecture.md, shown true: a throw-away kernel (one library file + one bench registration,
with a tuning entry beside its launcher), dispatch path (one file) and peer (an adapter + a stand-in), each put into
its package's folder as a new file and nothing else edited, are listed by `moebench list` (and `list --configs`),
collected by the parametrised tests' collection functions, and timed by a tiny CPU run of each.

The files live under tmp_path; a fresh process imports moebench.kernels, moebench.bench, moebench.dispatch,
moebench.peers and tests.standins with those folders as one more folder of each package (their `__path__`), which is
what dropping the files into the packages does to the discovery (pkgutil walks each package's `__path__`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KERNEL = '''
"""throwaway_scale: rows times two, padded rows zero (a recipe test's kernel)."""
import torch
import triton
import triton.language as tl

from moebench.kernels._details.args import check_mask
from moebench.kernels._details.jit import check_triton_device
from moebench.kernels._details.tuning import Tunable, choose, register_tunable

__all__ = ["throwaway_scale", "throwaway_scale_torch"]

register_tunable(Tunable("throwaway_scale", {"w1": 1, "w2": 2}, lambda hidden: f"H={hidden}",
                         lambda hidden: ("w1", 1), "w1 at every shape"))


def throwaway_scale_torch(x, is_padding=None):
    out = x * 2
    return out if is_padding is None else out.masked_fill(is_padding[:, None], 0.0)


@triton.jit
def _scale_kernel(x_ptr, pad_ptr, out_ptr, H, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0) * 2
    if HAS_MASK:
        x = tl.where(tl.load(pad_ptr + row) != 0, 0.0, x)
    tl.store(out_ptr + row * H + cols, x, mask=cols < H)


def throwaway_scale(x, is_padding=None, *, out=None, config=None):
    check_triton_device(x)
    check_mask(is_padding, x.shape[0])
    out = torch.empty_like(x) if out is None else out
    choice = choose("throwaway_scale", x.device, config, hidden=x.shape[1])
    pad = is_padding.to(torch.int8) if is_padding is not None else x
    _scale_kernel[(x.shape[0],)](x, pad, out, x.shape[1], HAS_MASK=is_padding is not None,
                                 BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=choice.config)
    return out
'''

BENCH = '''
from moebench.check import compare_close
from moebench.inputs import make_batch
from moebench.kernels.throwaway_scale import throwaway_scale, throwaway_scale_torch
from moebench.measure.cost import PointWork
from moebench.registry import Case, Routing, declare_work, register_variants
import torch


def _build(variant):
    fn = throwaway_scale if variant == "triton" else throwaway_scale_torch

    def build(p, ctx):
        batch = make_batch(p, ctx.device)
        x = batch.hidden.float()
        out = torch.empty_like(x)
        ref = throwaway_scale_torch(x, batch.mask)

        def run():
            if variant == "triton":
                return fn(x, batch.mask, out=out)
            return out.copy_(fn(x, batch.mask))

        def check():
            out.fill_(float("nan"))
            run()
            return compare_close("out", out, ref, 1e-6, 1e-6)
        return Case(run=run, check=check, bytes_moved=2 * x.numel() * 4,
                    routing=Routing(torch.zeros(x.shape[0], 1, dtype=torch.int32, device=ctx.device),
                                    batch.is_padding, p.num_experts))
    return build


register_variants("throwaway_scale", {"triton": "Triton rows x 2, padded rows zero",
                                      "torch": "eager torch (the reference)"}, _build)
declare_work("throwaway_scale", PointWork(call=lambda p: (0.0, p.num_tokens * p.hidden * 8.0)))
'''

PATH = '''
from moebench.dispatch.agrs import AGRSPath
from moebench.dispatch.base import dispatch_path


@dispatch_path("throwaway_agrs", description="agrs on its torch-reference kernels (a recipe test's path)")
class ThrowawayPath(AGRSPath):
    def __init__(self, layout, **kw):
        super().__init__(layout, use_triton=False, **kw)
'''

PEER = '''
from moebench.peers._lib import Library, register_adapter, router_after, router_out

THROWLIB = Library("throwlib", "moebench_throwlib_is_not_installed", lambda: None)


def make_topk(lib):
    def fn(logits, top_k, renormalize, is_padding=None, bias=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        return router_after(weights, ids, is_padding, new=lib.softmax_topk(logits, top_k), renormalize=renormalize)
    return fn


register_adapter(THROWLIB, "topk_softmax", "throwlib", "softmax_topk", make_topk, "throwlib's softmax + top-k",
                 validate=lambda p: "bias: throwlib takes none" if p.bias else None)
'''

STANDIN = '''
import torch

MOEBENCH_STANDIN = "throwlib"


def softmax_topk(logits, k):
    w, i = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return w, i.to(torch.int32)
'''

SWEEPS = {
    "kernel": ("kernel", ["throwaway_scale.triton", "throwaway_scale.torch"]),
    "dispatch": ("dispatch", ["dispatch.throwaway_agrs"]),
    "peer": ("router", ["topk_softmax.throwlib"]),
}

DRIVER = '''
import contextlib, importlib.util, io, json, sys
from pathlib import Path

tmp = Path(sys.argv[1])


def import_with_folder(name, folder):
    """Import the package `name` with tmp/folder as one more folder of its own: what a new file in it is."""
    spec = importlib.util.find_spec(name)
    spec.submodule_search_locations.append(str(tmp / folder))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    spec.loader.exec_module(module)


for name, folder in (("moebench.kernels", "kernels"), ("moebench.bench", "bench"), ("moebench.dispatch", "dispatch"),
                     ("moebench.peers", "peers"), ("tests.standins", "standins")):
    import_with_folder(name, folder)

import moebench.kernels
from moebench import registry
from moebench.cli import main
from moebench.kernels.runtime import tuning
from moebench.peers._lib import libraries
from tests.standins import standins

out = {"exported": "throwaway_scale_torch" in moebench.kernels.__all__}
for key, args in (("list", ["list"]), ("configs", ["list", "--configs"])):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out[key + "_code"] = main(args)
    out[key] = buf.getvalue()
from tests.bench.test_bench_contract import contract_impls, skip_reason
from tests.dispatch.test_dispatch import cpu_paths
from tests.peers.test_peers import adapter_points
out["contract"] = contract_impls()
out["contract_skips"] = {n: skip_reason(registry.get(n)) for n in out["contract"] if n.startswith("throwaway_scale")}
out["paths"] = list(cpu_paths())
out["adapters"] = list(adapter_points())
out["tunables"] = list(tuning.tunable_kernels())
libraries()["throwlib"].bind(standins()["throwlib"])
out["runs"] = {}
for name in sys.argv[2:]:
    with contextlib.redirect_stdout(io.StringIO()):
        out["runs"][name] = main(["run", str(tmp / f"{name}.yaml"), "--out", str(tmp / "runs" / name),
                                  "--device", "cpu", "--in-process", "--no-plots"])
(tmp / "out.json").write_text(json.dumps(out))
'''


def _write_throwaways(tmp: Path) -> None:
    for folder, name, text in (("kernels", "throwaway_scale", KERNEL), ("bench", "throwaway_scale", BENCH),
                               ("dispatch", "throwaway_agrs", PATH), ("peers", "throwlib", PEER),
                               ("standins", "throwlib_standin", STANDIN)):
        (tmp / folder).mkdir(exist_ok=True)
        (tmp / folder / f"{name}.py").write_text(textwrap.dedent(text))
    for name, (target, impls) in SWEEPS.items():
        (tmp / f"{name}.yaml").write_text(
            f"name: throwaway_{name}\ntarget: {target}\nimpls: [{', '.join(impls)}]\n"
            "fixed: {num_tokens: 8, hidden: 32, num_experts: 8, top_k: 2, padding_ratio: 0.25, ep_size: 1}\n"
            "axes: {mask: [true, false]}\ntiming: {mode: wall, warmup: 0, iters: 2}\n")


def test_a_new_kernel_path_and_peer_are_listed_collected_and_timed(tmp_path):
    _write_throwaways(tmp_path)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path), *SWEEPS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    new = ["throwaway_scale.triton", "throwaway_scale.torch", "dispatch.throwaway_agrs", "topk_softmax.throwlib"]
    assert out["list_code"] == 0 and out["configs_code"] == 0
    listed = {line.split()[0] for line in out["list"].splitlines() if line.startswith("  ")}
    assert set(new) <= listed  # moebench list
    assert "# throwaway_scale: rule w1 at every shape\n  w1 w2" in out["configs"]  # its tuning entry, found
    assert "throwaway_scale" in out["tunables"] and out["exported"]
    assert set(new) <= set(out["contract"])  # the contract test collects all four
    assert out["contract_skips"] == {"throwaway_scale.torch": None, "throwaway_scale.triton": None}
    assert "throwaway_agrs" in out["paths"]  # test_dispatch's path tests
    assert "topk_softmax.throwlib" in out["adapters"]  # test_peers' adapter check against the stand-in
    assert out["runs"] == {name: 0 for name in SWEEPS}  # every point checked ok and timed
    for name, (_, impls) in SWEEPS.items():
        (run_dir,) = (tmp_path / "runs" / name).iterdir()
        records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
        assert sorted({r["impl"] for r in records}) == sorted(impls) and len(records) == 2 * len(impls)
        assert all(r["status"] == "ok" and r["stats"]["p50"] > 0 for r in records), name
