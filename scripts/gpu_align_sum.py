#!/usr/bin/env python3
"""Check and time moe_align_block_size and masked_moe_sum on one GPU (issue 3 targets).

    python3 scripts/gpu_align_sum.py               # the target shapes, about 20-30 s including JIT compiles
    python3 scripts/gpu_align_sum.py --sweep-block-routes   # plus alignment at 128..2048 routes per program and
                                                            # masked_moe_sum launch shapes (under 60 s in all)
    python3 scripts/gpu_align_sum.py --cpu-smoke   # the script's own logic at tiny shapes in the interpreter

Alignment: T in {64, 8192, 65536}, K=8, E=256, block_size 64, a quarter of the rows padded (ids -1); Triton vs the
eager torch reference (stable argsort + counting). Targets: T=8192 under 20 us (GPU.md: eager torch 285 us).
masked_moe_sum: T=8192, K=8, H=7168 bf16, padding 0 and 0.5 (NaN in the -1 slots), vs eager
`intermediate.sum(dim=1)` (GPU.md: 332 us). Targets: within 10% of eager sum unpadded; padded at most 0.6x its own
unpadded time.
Every output is checked exactly against the reference before it is timed (a wrong one is reported, not timed).
The `#` lines before the table: the alignment's launch shapes and per-kernel device time (count / scan / scatter,
torch.profiler) at T=64 and the middle T, then (with the sweep) the same per block_routes and the masked sum per
launch shape (rows x columns per program, warps).
Times: median over --reps replays of a CUDA graph holding --unroll calls (us per call); a path that cannot be
captured falls back to CUDA events and says so. GB/s counts the bytes the implementation must move (align: ids
read + outputs written; sum: valid slots read + output written); %roof is against the 4247 GB/s copy roof.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

import torch  # noqa: E402
from gpu_common import BYTE_ROOF, env_line, print_table, time_graph  # noqa: E402 (puts the repo on sys.path)

from moebench.kernels.masked_moe_sum import (  # noqa: E402
    SumLaunch,
    masked_moe_sum,
    masked_moe_sum_torch,
    sum_launch_config,
)
from moebench.kernels.moe_align_block_size import (  # noqa: E402
    align_launch_shapes,
    align_workspace,
    alloc_align_outputs,
    default_block_routes,
    moe_align_block_size,
    moe_align_block_size_torch,
)


def random_routing(num_tokens: int, top_k: int, num_experts: int, padding_ratio: float, device, seed: int):
    """Distinct experts per token (uniform), trailing rows padded with -1 (as a masked router emits)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g, device=device)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    num_padded = int(round(num_tokens * padding_ratio))
    if num_padded:
        ids[num_tokens - num_padded:] = -1
    return ids


def same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want))


def align_rows(args, device) -> list[list[str]]:
    rows = []
    E, K, bs = args.experts, 8, args.block_size
    for T in args.align_tokens:
        ids = random_routing(T, K, E, args.align_padding, device, seed=T)
        out = alloc_align_outputs(ids.numel(), E, bs, device)
        ws = align_workspace(ids.numel(), E, device)
        ref = moe_align_block_size_torch(ids, E, bs)
        for t in (*out, ws):
            t.fill_(-0x5A5A5A5A)  # poison: an element the kernels forget to write shows up as a mismatch
        got = moe_align_block_size(ids, E, bs, out=out, workspace=ws)
        ok = same(got, ref)
        nbytes = ids.numel() * 4 + sum(t.numel() * 4 for t in out)
        us_torch, mode_torch = time_graph(lambda: moe_align_block_size_torch(ids, E, bs), device, args.unroll,
                                         args.reps)
        if ok:
            us, mode = time_graph(lambda: moe_align_block_size(ids, E, bs, out=out, workspace=ws), device,
                                 args.unroll, args.reps)
            rows.append([f"align T={T}", "triton", "ok", f"{us:.1f}", f"{nbytes / us / 1e3:.0f}",
                         f"{100 * nbytes / us / 1e3 / (BYTE_ROOF / 1e9):.1f}", f"{us_torch / us:.1f}x vs torch",
                         mode])
        else:
            bad = [int((g != w).sum()) for g, w in zip(got, ref)]
            rows.append([f"align T={T}", "triton", f"WRONG {bad}", "-", "-", "-", "-", "-"])
        rows.append([f"align T={T}", "torch", "ref", f"{us_torch:.1f}", f"{nbytes / us_torch / 1e3:.0f}",
                     f"{100 * nbytes / us_torch / 1e3 / (BYTE_ROOF / 1e9):.1f}", "1.0x", mode_torch])
    return rows


def align_breakdown(args, device, T: int, block_routes: int | None = None) -> str:
    """Per-kernel device time of the three alignment launches at T tokens (torch.profiler), if it works.

    With `block_routes`, that many routes per program instead of the default (checked exactly first), and the
    graph-replay time of the whole alignment too.
    """
    if device.type != "cuda":
        return ""
    used = block_routes or default_block_routes(T * 8)
    shapes = align_launch_shapes(T * 8, args.experts, args.block_size, used)
    label = (f"# align T={T} block_routes={block_routes or f'default ({used})'} grids "
             f"count {shapes['count_grid']} scan {shapes['scan_grid']} scatter {shapes['scatter_grid']} "
             f"(route blocks {shapes['num_blocks']}, {shapes['route_warps']} warps):")
    try:
        from torch.profiler import ProfilerActivity, profile

        ids = random_routing(T, 8, args.experts, args.align_padding, device, seed=T)
        out = alloc_align_outputs(ids.numel(), args.experts, args.block_size, device)
        ws = align_workspace(ids.numel(), args.experts, device, block_routes=block_routes)

        def call():
            return moe_align_block_size(ids, args.experts, args.block_size, out=out, workspace=ws,
                                        block_routes=block_routes)
        for t in (*out, ws):
            t.fill_(-0x5A5A5A5A)
        if not same(call(), moe_align_block_size_torch(ids, args.experts, args.block_size)):
            return f"{label} WRONG"
        whole = ""
        if block_routes:
            us, mode = time_graph(call, device, args.unroll, args.reps)
            whole = f" whole {us:.1f} us ({mode});"
        torch.cuda.synchronize()
        n = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                call()
            torch.cuda.synchronize()
        parts = []
        for ev in prof.key_averages():
            if "_align_" in ev.key:
                total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                parts.append(f"{ev.key.split('_align_')[-1]} {total / n:.1f} us")
        return f"{label}{whole} per-kernel device time: " + ", ".join(sorted(parts))
    except Exception as e:  # the breakdown is a diagnostic only
        return f"{label} breakdown unavailable: {type(e).__name__}: {e}"


def sum_rows(args, device) -> list[list[str]]:
    rows = []
    T, K, H = args.sum_tokens, 8, args.hidden
    g = torch.Generator(device=device)
    g.manual_seed(1)
    x = torch.randn(T, K, H, generator=g, device=device, dtype=torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    eager_out = torch.empty_like(out)
    default = sum_launch_config(H)
    launches = [default]
    if args.sweep_block_routes:  # launch shapes around the default; rows1 H1024 w4 is the previous kernel's shape
        launches += [c for c in (SumLaunch(1, 1024, 4), SumLaunch(4, 1024, 4), SumLaunch(2, 2048, 8),
                                 SumLaunch(1, 2048, 8), SumLaunch(2, 512, 2), SumLaunch(4, 512, 4))
                     if c != default and c.block_h <= H]
        if CPU_SMOKE:
            launches += [SumLaunch(1, 128, 1), SumLaunch(4, 64, 1)]
    unpadded_us: dict[SumLaunch, float] = {}
    eager_us = None
    for padding in (0.0, 0.5):
        ids = random_routing(T, K, 256, padding, device, seed=2)
        if padding:
            x[ids < 0] = float("nan")  # a skipped slot that gets loaded turns its row into NaN
        ref = masked_moe_sum_torch(x, ids)
        valid_slots = int((ids >= 0).sum())
        nbytes = valid_slots * H * 2 + T * H * 2
        us_eager, mode_eager = time_graph(lambda: torch.sum(x, dim=1, out=eager_out), device, args.unroll,
                                         args.reps)
        if padding == 0.0:
            eager_us = us_eager
        for launch in launches:
            name = "triton" if launch == default else "triton " + launch.short()
            out.fill_(float("nan"))
            masked_moe_sum(x, ids, out=out, launch=launch)
            mismatches = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
            finite = bool(torch.isfinite(out).all())
            if mismatches == 0 and finite:
                us, mode = time_graph(lambda: masked_moe_sum(x, ids, out=out, launch=launch), device, args.unroll,
                                     args.reps)
                note = f"{eager_us / us:.2f}x of eager sum(pad 0) speed"
                if padding == 0.0:
                    unpadded_us[launch] = us
                elif launch in unpadded_us:
                    note += f", {us / unpadded_us[launch]:.2f}x own unpadded time (target <= 0.6)"
                rows.append([f"sum pad={padding}", name, "ok", f"{us:.1f}", f"{nbytes / us / 1e3:.0f}",
                             f"{100 * nbytes / us / 1e3 / (BYTE_ROOF / 1e9):.1f}", note, mode])
            else:
                rows.append([f"sum pad={padding}", name, f"WRONG mism={mismatches} finite={finite}", "-", "-", "-",
                             "-", "-"])
        all_bytes = T * K * H * 2 + T * H * 2
        rows.append([f"sum pad={padding}", "eager sum(dim=1)", "unmasked", f"{us_eager:.1f}",
                     f"{all_bytes / us_eager / 1e3:.0f}", f"{100 * all_bytes / us_eager / 1e3 / (BYTE_ROOF / 1e9):.1f}",
                     "reads every slot", mode_eager])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Triton's CPU interpreter")
    ap.add_argument("--unroll", type=int, default=20, help="calls captured per CUDA graph")
    ap.add_argument("--reps", type=int, default=30, help="graph replays timed")
    ap.add_argument("--sweep-block-routes", action="store_true",
                    help="also time the alignment at T=8192 with 128..2048 routes per program and masked_moe_sum "
                         "under other launch shapes (adds ~20 s)")
    args = ap.parse_args()
    if CPU_SMOKE:
        device = torch.device("cpu")
        args.align_tokens, args.experts, args.block_size, args.align_padding = [8, 40], 16, 16, 0.25
        args.sum_tokens, args.hidden = 16, 256
        args.unroll, args.reps = 1, 10
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        args.align_tokens, args.experts, args.block_size, args.align_padding = [64, 8192, 65536], 256, 64, 0.25
        args.sum_tokens, args.hidden = 8192, 7168
    t0 = time.perf_counter()
    rows = align_rows(args, device)
    mid_tokens = args.align_tokens[len(args.align_tokens) // 2]
    breakdown = "\n".join(b for b in (align_breakdown(args, device, T) for T in
                                       dict.fromkeys((args.align_tokens[0], mid_tokens))) if b)
    if args.sweep_block_routes:
        for block_routes in (128, 256, 512, 1024, 2048):
            line = align_breakdown(args, device, mid_tokens, block_routes)
            breakdown += ("\n" if breakdown and line else "") + line
    rows += sum_rows(args, device)
    print(env_line(device, f"{time.perf_counter() - t0:.0f} s"))
    if breakdown:
        print(breakdown)
    print_table(["case", "impl", "check", "us", "GB/s", "%roof", "ratio", "timing"], rows)
    return 1 if any(r[2].startswith("WRONG") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
