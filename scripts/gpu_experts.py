#!/usr/bin/env python3
"""Check and time fused_experts.triton against torch._grouped_mm on one GPU (the issue-3 target shape).

    python3 scripts/gpu_experts.py                 # 128 local experts, 4096 tokens x top-8, H=7168, I=2048 (< 60 s)
    python3 scripts/gpu_experts.py --no-sweep      # skip the per-kernel config sweep

Cases: 0% and 50% of routes skipped (the trailing half of the tokens are padding: every slot -1).
Table 1: us (median of --iters CUDA-event samples), TFLOP/s of the useful work, roofline us
(max(flops / 714 TFLOP/s, bytes / 4247 GB/s), bytes as fused_experts.triton declares them), fraction of roofline,
and grouped_mm_us / triton_us (>= 0.8 is the target). Rows: the default config (choose_config, printed above the
table), the same tiles with the weights' TMA setting flipped, the previous default (BM64, no TMA), the default's two
GEMM kernels alone, and grouped_mm = the two torch._grouped_mm GEMMs plus the eager SwiGLU on rows already sorted
by expert (its sort, gather and weighted sum are not timed). The `# skip` lines give the default's stages:
alignment (moe_align_block_size's kernels), gate/up, down, slot sum.
Table 2 (sweep): each GEMM kernel alone under a few configs near the default (BLOCK_M 128), checked first on
sampled blocks against fp32 references. Every timed output is checked first (the whole layer against an fp32
reference on sampled rows), and a wrong one is reported, not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import os

# --cpu-smoke: run the script's own logic at tiny shapes in Triton's CPU interpreter (set before triton loads)
CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from gpu_common import BYTE_ROOF, FLOP_ROOF, env_line, time_events  # noqa: E402 (puts the repo on sys.path)

from moebench.kernels._grouped_gemm import (  # noqa: E402
    ExpertsConfig,
    _weight_operand,
    GemmConfig,
    align_routes,
    down_proj,
    gate_up_swiglu,
    sum_slots,
)
from moebench.kernels.fused_experts import (  # noqa: E402
    choose_config,
    fused_experts,
    fused_experts_torch,
    make_expert_weights,
    make_workspace,
)

# The previous default at this shape (BM64, no TMA), kept as a row of table 1.
OLD_DEFAULT = ExpertsConfig(64, GemmConfig(128, 64, 8, 4, 4), GemmConfig(256, 64, 8, 4, 4))

# (BLOCK_M, GemmConfig) candidates near the default; block_n of gate/up counts each half (a program computes
# 2*block_n columns). The first of each list is the default at the target shape.
GATE_UP_CANDIDATES = [
    (128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True)),
    (128, GemmConfig(128, 64, 8, 8, 4, weight_tma=True)),
    (128, GemmConfig(128, 64, 8, 8, 4)),
    (128, GemmConfig(128, 64, 16, 8, 3, weight_tma=True)),
]
DOWN_CANDIDATES = [
    (128, GemmConfig(256, 64, 8, 8, 3, weight_tma=True)),
    (128, GemmConfig(256, 64, 8, 8, 3)),
    (128, GemmConfig(256, 64, 8, 8, 4, weight_tma=True)),
    (128, GemmConfig(256, 64, 16, 8, 3, weight_tma=True)),
]


def cuda_time_us(fn, iters: int) -> float:
    """Median us of `iters` CUDA-event-timed calls after 3 warm-up calls (one wall-clock call on the CPU)."""
    return time_events(fn, torch.device("cpu" if CPU_SMOKE else "cuda"), iters)


def frob(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def work(ids: torch.Tensor, E: int, H: int, I: int, M: int) -> tuple[float, float]:
    """(flops, bytes) of the useful work, as fused_experts.triton declares them."""
    valid = (ids >= 0) & (ids < E)
    n = int(valid.sum())
    used = int(torch.unique(ids[valid]).numel())
    flops = 2.0 * n * 3 * H * I
    nbytes = used * 3 * H * I * 2 + int(valid.any(1).sum()) * H * 2 + n * (I + H) * 4 + M * H * 2 + ids.numel() * 8
    return flops, float(nbytes)


def make_case(M, K, E, H, skip, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.rand(M, E, generator=g, device=dev).topk(K, dim=1).indices.to(torch.int32)  # uniform, distinct
    w = torch.softmax(torch.randn(M, K, generator=g, device=dev), dim=1)
    num_padded = int(round(M * skip))
    if num_padded:
        ids[M - num_padded:] = -1
        w[M - num_padded:] = 0.0
    return x, ids.contiguous(), w.contiguous()


def grouped_mm_fn(x, w13, w2, ids, I):
    """The baseline's timed part: both grouped GEMMs + SwiGLU on rows pre-sorted by expert (valid routes only)."""
    E, K = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)[:E]
    order = order[:int(counts.sum())]
    offs = counts.cumsum(0).to(torch.int32)
    rows = x.index_select(0, order // K)
    w13t, w2t = w13.transpose(-2, -1), w2.transpose(-2, -1)
    state = {}

    def gemm1():
        state["h"] = torch._grouped_mm(rows, w13t, offs=offs)

    def swiglu():
        h = state["h"]
        state["a"] = torch.nn.functional.silu(h[:, :I]) * h[:, I:]

    def gemm2():
        state["y"] = torch._grouped_mm(state["a"], w2t, offs=offs)

    def full():
        gemm1()
        swiglu()
        gemm2()
    return full, gemm1, gemm2, order


def flip_tma(cfg: ExpertsConfig) -> ExpertsConfig:
    """The same tiles with the weights' TMA setting of both kernels flipped."""
    return dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, weight_tma=not cfg.gate_up.weight_tma),
                               down=dataclasses.replace(cfg.down, weight_tma=not cfg.down.weight_tma))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check-rows", type=int, default=256)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--json", type=str, default="", help="also write the results here")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the CPU interpreter (tests the script)")
    args = ap.parse_args()
    if CPU_SMOKE:
        args.tokens, args.top_k, args.experts, args.hidden, args.inter, args.check_rows = 24, 2, 4, 128, 64, 16
    elif not torch.cuda.is_available():
        print("# needs a CUDA GPU")
        return 2
    dev = torch.device("cpu" if CPU_SMOKE else "cuda")
    M, K, E, H, I = args.tokens, args.top_k, args.experts, args.hidden, args.inter
    t_start = time.time()
    print(env_line(dev))
    print(f"# M={M} tokens x top-{K} = {M * K} routes, {E} local experts, H={H}, I={I}")
    w13, w2 = make_expert_weights(E, H, I, seed=0, device=dev)
    have_gmm = hasattr(torch, "_grouped_mm") and (CPU_SMOKE or torch.cuda.get_device_capability() >= (9, 0))
    # the default of the real shape (the interpreter's own default would be CPU-sized)
    cfg = choose_config(M * K, E, H, I) if not CPU_SMOKE else ExpertsConfig(128, GATE_UP_CANDIDATES[0][1],
                                                                              DOWN_CANDIDATES[0][1])
    variants = [("triton (all)", cfg), ("tma flipped", flip_tma(cfg))]
    if OLD_DEFAULT != cfg:
        variants.append(("old default", OLD_DEFAULT))
    for label, c in variants:
        up_tma = _weight_operand(w13, c.gate_up.block_n, c.gate_up, I)[1]
        down_tma = _weight_operand(w2, c.down.block_n, c.down, H)[1]
        print(f"# {'default config' if c is cfg else label}: {c.short()} (TMA in effect: gate_up {up_tma}, "
              f"down {down_tma})")
    results = {"shape": dict(M=M, K=K, E=E, H=H, I=I), "default_config": cfg.short(), "cases": [], "sweep": []}
    rows_table = []
    cases = {}
    for skip in (0.0, 0.5):
        x, ids, w = make_case(M, K, E, H, skip, dev)
        cases[skip] = (x, ids, w)
        flops, nbytes = work(ids, E, H, I, M)
        roof_us = max(flops / FLOP_ROOF, nbytes / BYTE_ROOF) * 1e6
        g = torch.Generator().manual_seed(1)
        sel = torch.randperm(M, generator=g)[:args.check_rows].sort().values.to(dev)
        ref = fused_experts_torch(x[sel], w13, w2, w[sel], ids[sel], out_dtype=torch.float32)
        padded_rows = (ids < 0).all(1)
        rec = {"skip": skip, "roof_us": roof_us, "flops": flops, "bytes": nbytes}
        times = {}
        for label, c in variants:
            ws = make_workspace(M, K, E, H, I, config=c, device=dev)
            out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=dev)
            try:
                fused_experts(x, w13, w2, w, ids, config=c, workspace=ws, out=out)
                err = frob(out[sel], ref)
                padded_ok = bool((out[padded_rows] == 0).all())
                ok = err < 1e-2 and bool(torch.isfinite(out).all()) and padded_ok
                rec[f"{label}.frob_rel"] = err
                if not ok:
                    print(f"# WRONG {label} ({c.short()}) at skip={skip}: frob_rel={err:.3g} padded rows zero: "
                          f"{padded_ok}")
                    times[label] = float("nan")
                    continue
                times[label] = cuda_time_us(lambda: fused_experts(x, w13, w2, w, ids, config=c, workspace=ws,
                                                                  out=out), args.iters)
            except Exception as ex:  # a config that does not compile is reported, the others still run
                print(f"# {label} ({c.short()}) failed: {type(ex).__name__}: {str(ex).splitlines()[0][:120]}")
                times[label] = float("nan")
                continue
            if c is cfg:  # the default's stages
                align_out = (ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch)
                s, e, n = align_routes(ids, E, c.block_m, out=align_out)
                t_align = cuda_time_us(lambda: align_routes(ids, E, c.block_m, out=align_out), args.iters)
                t_up = cuda_time_us(lambda: gate_up_swiglu(x, w13, s, e, n, K, c.block_m, c.gate_up, ws.act),
                                    args.iters)
                t_down = cuda_time_us(lambda: down_proj(ws.act, w2, w, s, e, n, c.block_m, c.down, ws.y), args.iters)
                t_sum = cuda_time_us(lambda: sum_slots(ws.y, ids, E, out, block_h=c.reduce_block_h), args.iters)
                rec.update(align_us=t_align, gate_up_us=t_up, down_us=t_down, sum_us=t_sum, num_post_padded=int(n),
                           blocks=int(n) // c.block_m)
            del ws, out
        rec.update({f"{label}_us": t for label, t in times.items()})
        rec["triton_us"] = times["triton (all)"]
        rec["ok"] = times["triton (all)"] == times["triton (all)"]  # not NaN
        t_gmm = t_g1 = t_g2 = float("nan")
        if have_gmm:
            full, g1, g2, _ = grouped_mm_fn(x, w13, w2, ids, I)
            full()
            t_gmm = cuda_time_us(full, args.iters)
            t_g1 = cuda_time_us(g1, args.iters)
            t_g2 = cuda_time_us(g2, args.iters)
            rec.update(grouped_mm_us=t_gmm, grouped_mm_gemm1_us=t_g1, grouped_mm_gemm2_us=t_g2)
        results["cases"].append(rec)
        tf = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
        pct = f"{int(skip * 100)}%"
        for label, _ in variants:
            t = times[label]
            rows_table.append((pct, label, t, tf(t), roof_us, roof_us / t, t_gmm / t))
        if "gate_up_us" in rec:
            t_gemms = rec["gate_up_us"] + rec["down_us"]
            rows_table.append((pct, "triton gemms", t_gemms, tf(t_gemms), roof_us, roof_us / t_gemms, t_gmm / t_gemms))
            print(f"# skip {pct}: frob_rel {rec['triton (all).frob_rel']:.2e}; triton stages: align "
                  f"{rec['align_us']:.0f} us, gate_up {rec['gate_up_us']:.0f} us, down {rec['down_us']:.0f} us, sum "
                  f"{rec['sum_us']:.0f} us (blocks: {rec['blocks']}); grouped_mm gemm1 {t_g1:.0f} us, gemm2 "
                  f"{t_g2:.0f} us")
        rows_table.append((pct, "grouped_mm", t_gmm, tf(t_gmm), roof_us, roof_us / t_gmm, 1.0))

    print()
    print(f"{'skip':>5} {'impl':<14} {'us':>9} {'TFLOP/s':>8} {'roof_us':>8} {'frac':>6} {'gmm/x':>6}")
    for r in rows_table:
        print(f"{r[0]:>5} {r[1]:<14} {r[2]:9.1f} {r[3]:8.1f} {r[4]:8.1f} {r[5]:6.3f} {r[6]:6.3f}")
    c0, c5 = (next((c for c in results["cases"] if c["skip"] == s and c["ok"]), None) for s in (0.0, 0.5))
    if c0 and c5:
        saved, roof_saved = c0["triton_us"] - c5["triton_us"], c0["roof_us"] - c5["roof_us"]
        print(f"# 50% skipped: triton saved {saved:.0f} us of the roofline's {roof_saved:.0f} us "
              f"({saved / roof_saved:.2f}; target >= 0.8)")
        if "grouped_mm_us" in c0:
            print(f"# grouped_mm saved {c0['grouped_mm_us'] - c5['grouped_mm_us']:.0f} us")
    print(f"# table 1 took {time.time() - t_start:.0f} s")

    if not args.no_sweep:
        sweep(args, cases, w13, w2, results)
    print(f"# total {time.time() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(c["ok"] for c in results["cases"]) else 1


def sampled_block_refs(x, w13, w2, w, sorted_ids, expert_ids, num_post, top_k, block_m, num_blocks, seed=3):
    """fp32 references of both GEMM kernels on a seeded sample of blocks: [(block, positions, routes, act fp32,
    act bf16 (the down kernel's input), y fp32)]. A block's outputs depend only on its own rows and expert."""
    I = w13.shape[1] // 2
    R = w.numel()
    total = int(num_post) // block_m
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(total, generator=g)[:num_blocks].sort().values.tolist()
    refs = []
    for b in picks:
        e = int(expert_ids[b])
        routes = sorted_ids[b * block_m:(b + 1) * block_m].long()
        ok = routes < R
        pos = torch.arange(b * block_m, (b + 1) * block_m, device=x.device)[ok]
        routes = routes[ok]
        h = x[routes // top_k].float() @ w13[e].float().T
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        act_bf16 = act.to(torch.bfloat16)
        y = (act_bf16.float() @ w2[e].float().T) * w.reshape(-1)[routes].float()[:, None]
        refs.append((b, pos, routes, act, act_bf16, y))
    return refs


def sweep(args, cases, w13, w2, results) -> None:
    M, K, E, H, I = args.tokens, args.top_k, args.experts, args.hidden, args.inter
    t0 = time.time()
    print()
    print(f"{'kernel':<8} {'BM':>4} {'BN':>4} {'BK':>3} {'wp':>3} {'st':>3} {'gm':>3} {'tma':>3} "
          f"{'us@0%':>9} {'us@50%':>9} {'TF@0%':>7} {'err':>8}")
    iters = max(3, args.iters // 2)
    best: dict[tuple[str, int], tuple[float, GemmConfig]] = {}
    for block_m in sorted({bm for bm, _ in GATE_UP_CANDIDATES + DOWN_CANDIDATES}):
        ups = [c for bm, c in GATE_UP_CANDIDATES if bm == block_m]
        downs = [c for bm, c in DOWN_CANDIDATES if bm == block_m]
        per_skip = {}
        for skip, (x, ids, w) in cases.items():
            ws = make_workspace(M, K, E, H, I, config=ExpertsConfig(block_m, ups[0], downs[0]), device=x.device)
            s, e, n = align_routes(ids, E, block_m, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch))
            ws.act.normal_(0, 0.5)  # realistic values for the down-proj timing at every skip level
            per_skip[skip] = (x, ids, w, ws, s, e, n)
        x, ids, w, ws, s, e, n = per_skip[0.0]
        refs = sampled_block_refs(x, w13, w2, w, s, e, n, K, block_m, num_blocks=4 if CPU_SMOKE else 12)
        valid_routes = int(((ids >= 0) & (ids < E)).sum())
        flops_up = 2.0 * valid_routes * H * 2 * I
        flops_down = 2.0 * valid_routes * I * H
        for kind, cands in (("gate_up", ups), ("down", downs)):
            for c in cands:
                tile_dim = I if kind == "gate_up" else H
                if c.weight_tma and not _weight_operand(w13 if kind == "gate_up" else w2, c.block_n, c, tile_dim)[1]:
                    c = dataclasses.replace(c, weight_tma=False)  # the layout does not allow it: say so
                row = {"kernel": kind, "block_m": block_m, **c.__dict__}
                try:
                    x, ids, w, ws, s, e, n = per_skip[0.0]
                    if kind == "gate_up":
                        ws.act.fill_(float("nan"))
                        gate_up_swiglu(x, w13, s, e, n, K, block_m, c, ws.act)
                        got = torch.cat([ws.act[pos] for _, pos, _, _, _, _ in refs])
                        err = frob(got, torch.cat([r[3] for r in refs]))
                    else:
                        for _, pos, _, _, act_bf16, _ in refs:
                            ws.act[pos] = act_bf16
                        ws.y.fill_(float("nan"))
                        down_proj(ws.act, w2, w, s, e, n, block_m, c, ws.y)
                        got = torch.cat([ws.y[routes] for _, _, routes, _, _, _ in refs])
                        err = frob(got, torch.cat([r[5] for r in refs]))
                    row["err"] = err
                    if not err < 1e-2:
                        row["status"] = "wrong"
                        print(f"{kind:<8} {block_m:4d} {c.block_n:4d} {c.block_k:3d} {c.num_warps:3d} "
                              f"{c.num_stages:3d} {c.group_m:3d} {int(c.weight_tma):3d}  WRONG frob_rel {err:.3g}")
                        results["sweep"].append(row)
                        continue
                    times = {}
                    for skip, (x, ids, w, ws2, s2, e2, n2) in per_skip.items():
                        if kind == "gate_up":
                            fn = lambda: gate_up_swiglu(x, w13, s2, e2, n2, K, block_m, c, ws2.act)  # noqa: E731
                        else:
                            fn = lambda: down_proj(ws2.act, w2, w, s2, e2, n2, block_m, c, ws2.y)  # noqa: E731
                        times[skip] = cuda_time_us(fn, iters)
                except Exception as ex:  # a config that does not compile (shared memory, registers) is reported
                    row["status"] = f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:80]}"
                    print(f"{kind:<8} {block_m:4d} {c.block_n:4d} {c.block_k:3d} {c.num_warps:3d} {c.num_stages:3d} "
                          f"{c.group_m:3d} {int(c.weight_tma):3d}  {row['status']}")
                    results["sweep"].append(row)
                    continue
                fl = flops_up if kind == "gate_up" else flops_down
                row.update(status="ok", us_0=times[0.0], us_50=times[0.5])
                results["sweep"].append(row)
                print(f"{kind:<8} {block_m:4d} {c.block_n:4d} {c.block_k:3d} {c.num_warps:3d} {c.num_stages:3d} "
                      f"{c.group_m:3d} {int(c.weight_tma):3d} {times[0.0]:9.1f} {times[0.5]:9.1f} "
                      f"{fl / times[0.0] / 1e6:7.1f} {err:8.1e}")
                key = (kind, block_m)
                score = times[0.0] + times[0.5]
                if key not in best or score < best[key][0]:
                    best[key] = (score, c)
        del per_skip
        if not CPU_SMOKE:
            torch.cuda.empty_cache()
    pairs = []
    for block_m in sorted({bm for _, bm in best}):
        if ("gate_up", block_m) in best and ("down", block_m) in best:
            up, down = best[("gate_up", block_m)], best[("down", block_m)]
            pairs.append((up[0] + down[0], ExpertsConfig(block_m, up[1], down[1])))
    for score, c in sorted(pairs, key=lambda t: t[0]):
        print(f"# best pair at BM={c.block_m}: {c.short()}  (us@0% + us@50% of both kernels: {score:.0f})")
    print(f"# sweep took {time.time() - t0:.0f} s")
    results["best_pairs"] = [(score, c.short()) for score, c in pairs]


if __name__ == "__main__":
    sys.exit(main())
