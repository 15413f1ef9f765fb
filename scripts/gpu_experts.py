#!/usr/bin/env python3
"""Check and time fused_experts.triton against torch._grouped_mm on one GPU (the issue-3 target shape).

    python3 scripts/gpu_experts.py                 # 128 local experts, 4096 tokens x top-8, H=7168, I=2048
    python3 scripts/gpu_experts.py --no-sweep      # skip the block-config sweep

Cases: 0% and 50% of routes skipped (the trailing half of the tokens are padding: every slot -1).
Table 1: us (median of --iters CUDA-event samples), TFLOP/s of the useful work, roofline us
(max(flops / 714 TFLOP/s, bytes / 4247 GB/s), bytes as fused_experts.triton declares them), fraction of roofline,
and grouped_mm_us / triton_us (>= 0.8 is the target). grouped_mm = the two torch._grouped_mm GEMMs plus the eager
SwiGLU on rows already sorted by expert (its sort, gather and weighted sum are not timed); triton = the whole
fused_experts (align + both GEMMs + slot sum) and, separately, its two GEMM kernels alone.
Table 2 (sweep): each GEMM kernel alone under candidate configs (BLOCK_M is shared by both kernels: the best
pair is chosen per BLOCK_M). Every timed output is checked first (fp32 reference on sampled rows; sweep
candidates against the fp32 per-kernel references), and a wrong one is reported, not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import os

# --cpu-smoke: run the script's own logic at tiny shapes in Triton's CPU interpreter (set before triton loads)
CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moebench.kernels._grouped_gemm import (  # noqa: E402
    ExpertsConfig,
    _weight_operand,
    GemmConfig,
    align_routes,
    down_proj,
    down_proj_torch,
    gate_up_swiglu,
    gate_up_swiglu_torch,
    sum_slots,
)
from moebench.kernels.fused_experts import (  # noqa: E402
    choose_config,
    fused_experts,
    fused_experts_torch,
    make_expert_weights,
    make_workspace,
)

FLOP_ROOF = 714e12
BYTE_ROOF = 4247e9

# (BLOCK_M, GemmConfig) candidates; block_n of gate/up counts each half (a program computes 2*block_n columns)
GATE_UP_CANDIDATES = [
    (64, GemmConfig(128, 64, 8, 4, 4)),
    (64, GemmConfig(128, 64, 8, 8, 4)),
    (64, GemmConfig(64, 64, 8, 4, 4)),
    (128, GemmConfig(128, 64, 8, 8, 3)),
    (128, GemmConfig(128, 64, 8, 8, 4)),
    (128, GemmConfig(64, 64, 8, 4, 4)),
    (64, GemmConfig(128, 64, 8, 4, 4, weight_tma=True)),
    (128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True)),
]
DOWN_CANDIDATES = [
    (64, GemmConfig(256, 64, 8, 4, 4)),
    (64, GemmConfig(256, 64, 8, 8, 4)),
    (64, GemmConfig(128, 64, 8, 4, 4)),
    (128, GemmConfig(256, 64, 8, 8, 3)),
    (128, GemmConfig(128, 64, 8, 8, 4)),
    (128, GemmConfig(128, 64, 8, 4, 4)),
    (64, GemmConfig(256, 64, 8, 4, 4, weight_tma=True)),
    (128, GemmConfig(256, 64, 8, 8, 3, weight_tma=True)),
]


def cuda_time_us(fn, iters: int, warmup: int = 3) -> float:
    if CPU_SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


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
    import triton

    dev = torch.device("cpu" if CPU_SMOKE else "cuda")
    M, K, E, H, I = args.tokens, args.top_k, args.experts, args.hidden, args.inter
    t_start = time.time()
    gpu = "CPU interpreter smoke run" if CPU_SMOKE else torch.cuda.get_device_name()
    print(f"# {gpu} torch {torch.__version__} triton {triton.__version__}")
    print(f"# M={M} tokens x top-{K} = {M * K} routes, {E} local experts, H={H}, I={I}")
    w13, w2 = make_expert_weights(E, H, I, seed=0, device=dev)
    have_gmm = hasattr(torch, "_grouped_mm") and (CPU_SMOKE or torch.cuda.get_device_capability() >= (9, 0))
    # the default of the real shape (the interpreter's own default would be CPU-sized)
    cfg = choose_config(M * K, E, H, I) if not CPU_SMOKE else ExpertsConfig(64, *[c for _, c in (
        GATE_UP_CANDIDATES[0], DOWN_CANDIDATES[0])])
    print(f"# default config: {cfg.short()}")
    results = {"shape": dict(M=M, K=K, E=E, H=H, I=I), "default_config": cfg.short(), "cases": [], "sweep": []}
    rows_table = []
    cases = {}
    for skip in (0.0, 0.5):
        x, ids, w = make_case(M, K, E, H, skip, dev)
        cases[skip] = (x, ids, w)
        flops, nbytes = work(ids, E, H, I, M)
        roof_us = max(flops / FLOP_ROOF, nbytes / BYTE_ROOF) * 1e6
        ws = make_workspace(M, K, E, H, I, config=cfg, device=dev)
        out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=dev)
        fused_experts(x, w13, w2, w, ids, workspace=ws, out=out)
        g = torch.Generator().manual_seed(1)
        sel = torch.randperm(M, generator=g)[:args.check_rows].sort().values.to(dev)
        ref = fused_experts_torch(x[sel], w13, w2, w[sel], ids[sel], out_dtype=torch.float32)
        err = frob(out[sel], ref)
        padded_ok = bool((out[(ids < 0).all(1)] == 0).all())
        ok = err < 1e-2 and bool(torch.isfinite(out).all()) and padded_ok
        rec = {"skip": skip, "frob_rel": err, "ok": ok, "roof_us": roof_us, "flops": flops, "bytes": nbytes}
        if not ok:
            print(f"# WRONG at skip={skip}: frob_rel={err:.3g} padded rows zero: {padded_ok}")
            results["cases"].append(rec)
            continue
        t_full = cuda_time_us(lambda: fused_experts(x, w13, w2, w, ids, workspace=ws, out=out), args.iters)
        s, e, n = align_routes(ids, E, cfg.block_m, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.counts))
        t_align = cuda_time_us(lambda: align_routes(ids, E, cfg.block_m, out=(ws.sorted_ids, ws.expert_ids,
                                                                              ws.num_post, ws.counts)), args.iters)
        t_up = cuda_time_us(lambda: gate_up_swiglu(x, w13, s, e, n, K, cfg.block_m, cfg.gate_up, ws.act), args.iters)
        t_down = cuda_time_us(lambda: down_proj(ws.act, w2, w, s, e, n, cfg.block_m, cfg.down, ws.y), args.iters)
        t_sum = cuda_time_us(lambda: sum_slots(ws.y, ids, E, out, block_h=cfg.reduce_block_h), args.iters)
        rec.update(triton_us=t_full, align_us=t_align, gate_up_us=t_up, down_us=t_down, sum_us=t_sum,
                   num_post_padded=int(n))
        # the same config with the weights through TMA descriptors: checked, then timed
        cfg_tma = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, weight_tma=True),
                                      down=dataclasses.replace(cfg.down, weight_tma=True))
        t_tma = float("nan")
        try:
            out.fill_(float("nan"))
            fused_experts(x, w13, w2, w, ids, config=cfg_tma, workspace=ws, out=out)
            err_tma = frob(out[sel], ref)
            if err_tma < 1e-2 and bool(torch.isfinite(out).all()):
                t_tma = cuda_time_us(lambda: fused_experts(x, w13, w2, w, ids, config=cfg_tma, workspace=ws,
                                                           out=out), args.iters)
            else:
                print(f"# WRONG with TMA weights at skip={skip}: frob_rel={err_tma:.3g}")
        except Exception as ex:
            print(f"# TMA variant failed: {type(ex).__name__}: {str(ex).splitlines()[0][:120]}")
        rec["triton_tma_us"] = t_tma
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
        rows_table.append((f"{int(skip * 100)}%", "triton (all)", t_full, tf(t_full), roof_us, roof_us / t_full,
                           t_gmm / t_full))
        rows_table.append((f"{int(skip * 100)}%", "triton+tma", t_tma, tf(t_tma), roof_us, roof_us / t_tma,
                           t_gmm / t_tma))
        rows_table.append((f"{int(skip * 100)}%", "triton gemms", t_up + t_down, tf(t_up + t_down), roof_us,
                           roof_us / (t_up + t_down), t_gmm / (t_up + t_down)))
        rows_table.append((f"{int(skip * 100)}%", "grouped_mm", t_gmm, tf(t_gmm), roof_us, roof_us / t_gmm, 1.0))
        print(f"# skip {int(skip * 100)}%: frob_rel {err:.2e}; triton stages: align {t_align:.0f} us, gate_up "
              f"{t_up:.0f} us, down {t_down:.0f} us, sum {t_sum:.0f} us (blocks: {int(n) // cfg.block_m}); "
              f"grouped_mm gemm1 {t_g1:.0f} us, gemm2 {t_g2:.0f} us")
        del ws, out

    print()
    print(f"{'skip':>5} {'impl':<14} {'us':>9} {'TFLOP/s':>8} {'roof_us':>8} {'frac':>6} {'gmm/x':>6}")
    for r in rows_table:
        print(f"{r[0]:>5} {r[1]:<14} {r[2]:9.1f} {r[3]:8.1f} {r[4]:8.1f} {r[5]:6.3f} {r[6]:6.3f}")
    c0, c5 = (next((c for c in results["cases"] if c["skip"] == s and "triton_us" in c), None) for s in (0.0, 0.5))
    if c0 and c5:
        saved, roof_saved = c0["triton_us"] - c5["triton_us"], c0["roof_us"] - c5["roof_us"]
        print(f"# 50% skipped: triton saved {saved:.0f} us of the roofline's {roof_saved:.0f} us "
              f"({saved / roof_saved:.2f}; target >= 0.8)")
        if "grouped_mm_us" in c0:
            print(f"# grouped_mm saved {c0['grouped_mm_us'] - c5['grouped_mm_us']:.0f} us")

    if not args.no_sweep:
        sweep(args, cases, w13, w2, results)
    print(f"# total {time.time() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def sweep(args, cases, w13, w2, results) -> None:
    M, K, E, H, I = args.tokens, args.top_k, args.experts, args.hidden, args.inter
    print()
    print(f"{'kernel':<8} {'BM':>4} {'BN':>4} {'BK':>3} {'wp':>3} {'st':>3} {'gm':>3} {'tma':>3} "
          f"{'us@0%':>9} {'us@50%':>9} {'TF@0%':>7} {'err':>8}")
    best: dict[tuple[str, int], tuple[float, GemmConfig]] = {}
    for block_m in sorted({bm for bm, _ in GATE_UP_CANDIDATES + DOWN_CANDIDATES}):
        ups = [c for bm, c in GATE_UP_CANDIDATES if bm == block_m]
        downs = [c for bm, c in DOWN_CANDIDATES if bm == block_m]
        per_skip = {}
        for skip, (x, ids, w) in cases.items():
            ws = make_workspace(M, K, E, H, I, config=ExpertsConfig(block_m, ups[0], downs[0]), device=x.device)
            s, e, n = align_routes(ids, E, block_m, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.counts))
            ws.act.normal_(0, 0.5)  # realistic values for the down-proj timing at every skip level
            per_skip[skip] = (x, ids, w, ws, s, e, n)
        # fp32 references of each kernel on the 0% case (the act reference feeds the down-proj reference)
        x, ids, w, ws, s, e, n = per_skip[0.0]
        num_post = int(n)
        act_ref = gate_up_swiglu_torch(x, w13, s, e, n, K, block_m)
        act_in = act_ref.to(torch.bfloat16)
        y_ref = down_proj_torch(act_in, w2, w, s, e, n, block_m)
        placed = ~torch.isnan(y_ref[:, 0])
        flops_up = 2.0 * int(placed.sum()) * H * 2 * I
        flops_down = 2.0 * int(placed.sum()) * I * H
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
                        err = frob(ws.act[:num_post], act_ref)
                    else:
                        ws.act[:num_post].copy_(act_in)
                        ws.y.fill_(float("nan"))
                        down_proj(ws.act, w2, w, s, e, n, block_m, c, ws.y)
                        err = frob(ws.y[placed], y_ref[placed])
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
                        times[skip] = cuda_time_us(fn, args.iters)
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
    results["best_pairs"] = [(score, c.short()) for score, c in pairs]


if __name__ == "__main__":
    sys.exit(main())
