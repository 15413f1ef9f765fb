"""Check and time launch-config variants of the expert GEMMs at a few shapes, beside the GEMM ceiling and the real
peers, in one process: what `moebench tune` would do for a handful of candidates, with the time of each kernel.

    python scripts/experts_probe.py --experts 32,128 --tokens 8192 --precision bf16,fp8 \
        --config bm128_tma --config "bm128_tma:down.act_tma=1,both.flatten=1" \
        --impl fused_experts.ceiling --impl fused_experts.fp8_deepgemm --out probe.json

A --config is a candidate of the precision's table (kernels/_details/experts_config.py), optionally with overrides
after a colon: `block_m=64`, `up.<field>=v`, `down.<field>=v`, `both.<field>=v` over GemmConfig's fields (block_n,
block_k, group_m, num_warps, num_stages, weight_tma, act_tma, flatten, warp_specialize, rescale, one_dot). A config
of the other precision's table is skipped. Each point goes through the registered impl (`fused_experts.triton` /
`.fp8`), so it is built, checked against its reference and then timed as a sweep would (CUDA-graph replay, median);
the kernels' own device times are the mean of 3 profiled eager calls, and the compiled kernels' registers, spills and
shared memory from Triton's cache. Before anything is timed, a pool of processes compiles every variant once
(Triton's disk cache is shared). The table printed last has one row per (shape, precision, config or impl). Exit 1
when a row failed its
check or did not run. `--device cpu` smoke-tests the script under Triton's interpreter (set TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from moebench.kernels.fused_experts_fp8 import FP8_CANDIDATES, fit_fp8_config
from moebench.kernels.grouped_gemm import BF16, EXPERTS_CANDIDATES, FP8_BLOCK, ExpertsConfig, fit_config

HIDDEN, INTER, TOP_K = 7168, 2048, 8
TABLES = {BF16: EXPERTS_CANDIDATES, FP8_BLOCK: FP8_CANDIDATES}
IMPL = {BF16: "fused_experts.triton", FP8_BLOCK: "fused_experts.fp8"}
_BOOL = {"weight_tma", "act_tma", "flatten", "warp_specialize", "rescale", "one_dot"}


def _bad(message: str):
    """Bad input: one line on stderr, exit 2, nothing run."""
    print(f"experts_probe.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_config(spec: str, precision: str, hidden: int = HIDDEN, inter: int = INTER) -> ExpertsConfig | None:
    """A --config spec as the precision's ExpertsConfig (fitted to H/I), or None when its name is another table's."""
    name, _, overrides = spec.partition(":")
    table = TABLES[precision]
    if name not in table:
        if name in TABLES[BF16 if precision == FP8_BLOCK else FP8_BLOCK]:
            return None
        _bad(f"--config {spec!r}: {name!r} is in neither candidate table")
    cfg = table[name]
    cfg = fit_config(cfg, hidden, inter) if precision == BF16 else fit_fp8_config(cfg, hidden)
    up, down, top = {}, {}, {}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        where, _, field = key.rpartition(".")
        if not value.lstrip("-").isdigit():
            _bad(f"--config {spec!r}: {key}={value!r}: expected an integer (0 or 1 for a flag)")
        v = bool(int(value)) if field in _BOOL else int(value)
        if where == "":
            top[field] = v
        else:
            if where not in ("up", "down", "both"):
                _bad(f"--config {spec!r}: {key!r}: expected <field>, up.<field>, down.<field> or both.<field>")
            for target in {"up": (up,), "down": (down,), "both": (up, down)}[where]:
                target[field] = v
    try:
        return dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, **up),
                                   down=dataclasses.replace(cfg.down, **down), name=spec, **top)
    except (TypeError, ValueError) as e:  # a field the config does not have, a knob it refuses
        _bad(f"--config {spec!r}: {e}")


def _params(experts: int, tokens: int, precision: str, config, shape=(HIDDEN, INTER, TOP_K)):
    from moebench.params import Params

    hidden, inter, top_k = shape
    return Params(num_tokens=tokens, num_experts=experts, num_local_experts=experts, top_k=top_k, hidden=hidden,
                  intermediate=inter, padding_ratio=0.0, padding_fill="repeat", dtype="bf16", group_size=128,
                  scale_format="fp32", config=config)


def _items(args) -> list[tuple[int, int, str, str, ExpertsConfig | None]]:
    """(experts, tokens, precision, label, config) of every moebench variant, then (…, impl, None) of every peer."""
    out = []
    for e in args.experts:
        for t in args.tokens:
            for prec in args.precision:
                for spec in args.config:
                    cfg = parse_config(spec, prec, args.hidden, args.inter)
                    if cfg is not None:
                        out.append((e, t, prec, spec, cfg))
            for impl in args.impl:
                out.append((e, t, "", impl, None))
    return out


def _build(item, ctx, shape):
    from moebench.registry import get

    e, t, prec, label, cfg = item
    impl = IMPL[prec] if cfg is not None else label
    return get(impl).build(_params(e, t, prec or BF16, cfg, shape), ctx)


def _warm(items, shape) -> list[str]:
    """Compile: one call of each moebench variant (a pool worker; Triton's disk cache keeps the kernels)."""
    from moebench.registry import RunContext

    ctx = RunContext(device=torch.device("cuda"))
    failed = []
    for item in items:
        try:
            case = _build(item, ctx, shape)
            case.run()
            torch.cuda.synchronize()
            if case.cleanup:
                case.cleanup()
        except Exception as exc:  # reported again, in full, by the timed pass
            failed.append(f"{item[3]}: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.empty_cache()
    return failed


def _compiled(kernel_names: tuple[str, ...]) -> dict[str, list[dict]]:
    """Registers, spills and shared memory of every compiled variant of the named Triton kernels."""
    from moebench.kernels import fused_experts_fp8, grouped_gemm_bf16

    found: dict[str, list[dict]] = {}
    for mod in (grouped_gemm_bf16, fused_experts_fp8):
        for name in kernel_names:
            fn = getattr(mod, name, None)
            if fn is None:
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for compiled in cache[0].values():
                    meta = compiled.metadata
                    found.setdefault(name, []).append(dict(
                        regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                        shared=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None),
                        stages=getattr(meta, "num_stages", None)))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description="Check and time launch-config variants of the expert GEMMs beside the "
                                 "GEMM ceiling and peers (see the module docstring).")
    ap.add_argument("--experts", type=lambda s: [int(v) for v in s.split(",")], default=[32])
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[8192])
    ap.add_argument("--precision", type=lambda s: [{"fp8": FP8_BLOCK}.get(v, v) for v in s.split(",")],
                    default=[BF16, FP8_BLOCK])
    ap.add_argument("--config", action="append", default=[],
                    help="NAME[:key=v,...]: a candidate of the precision's table, with GemmConfig overrides")
    ap.add_argument("--impl", action="append", default=[], help="a registered impl to time beside, e.g. a peer")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--inter", type=int, default=INTER)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the interpreter: a smoke test of this script)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    for prec in args.precision:
        if prec not in TABLES:
            print(f"--precision {prec!r}: expected bf16 or fp8", file=sys.stderr)
            return 2
    items = _items(args)
    shape = (args.hidden, args.inter, args.top_k)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"

    from moebench.measure import gpu_state
    from moebench.measure.kernel_time import top_kernels
    from moebench.measure.timing import measure
    from moebench.params import Timing
    from moebench.registry import RunContext

    t0 = time.time()
    ours = [it for it in items if it[4] is not None]
    if ours and args.workers > 1 and cuda:
        chunks = [ours[i::args.workers] for i in range(args.workers)]
        ctx_mp = __import__("multiprocessing").get_context("spawn")
        with ProcessPoolExecutor(len(chunks), mp_context=ctx_mp) as pool:
            for failed in pool.map(_warm, chunks, [shape] * len(chunks)):
                for line in failed:
                    print("warm-up failed:", line, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)

    ctx = RunContext(device=dev)
    rows = []
    for item in items:
        e, t, prec, label, cfg = item
        row = dict(experts=e, tokens=t, precision=prec or "-", what=label)
        try:
            case = _build(item, ctx, shape)
            res = case.check() if case.check else None
            row["check"] = "ok" if res is None or res.ok else f"FAIL {res.detail[:120]}"
            state, hook = gpu_state.around_timing(dev)
            r = measure(case.run, Timing(mode="cuda_graph" if cuda else "wall", warmup=3, iters=args.iters), dev,
                        graph_capturable=case.graph_capturable, hook=hook)
            row["sm_clock_mhz"] = (state.get("stop") or {}).get("sm_clock_mhz")
            row["p50_us"] = r.stats["p50"]
            row["cv"] = r.stats["cv"]
            row["tflops"] = case.flops / r.stats["p50"] / 1e6 if case.flops else None
            if cuda:
                row["kernels"] = [(n, round(us, 1)) for n, _, us in top_kernels(case.run, dev, iters=3, top=4)]
            row["config"] = case.info.get("config_detail", "")
            if case.cleanup:
                case.cleanup()
        except Exception as exc:
            row["check"] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    compiled = _compiled(("_gate_up_swiglu_kernel", "_down_proj_kernel", "_fp8_gate_up_kernel", "_fp8_down_kernel"))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, compiled=compiled, device=name,
                           torch=torch.__version__, triton=__import__("triton").__version__), f, indent=1,
                      default=str)
    print(json.dumps(compiled))
    print(f"\n{name}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    print(f"{'E':>4} {'T':>6} {'prec':>9} {'p50 us':>9} {'TFLOP/s':>8} {'MHz':>5}  check  what / kernels (us)")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
        ks = " ".join(f"{n.split('(')[0][:22]}={us}" for n, us in r.get("kernels", [])[:3])
        print(f"{r['experts']:>4} {r['tokens']:>6} {r['precision']:>9} {r.get('p50_us', float('nan')):>9.1f} "
              f"{tf:>8} {r.get('sm_clock_mhz') or '-':>5}  {r['check'][:5]:5}  {r['what']}  [{ks}]")
    return 0 if all(r.get("check") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
