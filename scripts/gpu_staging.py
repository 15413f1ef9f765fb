#!/usr/bin/env python3
"""Check bitwise and time the staging and expert-id kernels on one GPU (issue 3).

    python3 scripts/gpu_staging.py               # everything below, < 60 s on an H200
    python3 scripts/gpu_staging.py --no-tune     # skip the staging launch-shape sweep
    python3 scripts/gpu_staging.py --cpu-smoke   # the script's own logic at tiny shapes, Triton interpreter

Rows: prepare_moe_inputs (T in 1, 128, 8192, 32768; H=7168; group 32 and 128; packed UE8M0, plus the fp32
format and the mask-oblivious twin at T=8192; the eager torch reference at T=8192), apply_expert_map and
globalize_recv_topk_idx at T=64 and T=65536 (K=8). A quarter of the rows are padding.
Each kernel's outputs are compared bit for bit with its torch reference first (poisoned outputs); a wrong
row is reported and not timed. Times: median per call over CUDA-graph replays (20 calls captured per graph),
the eager reference with CUDA events. GB/s counts each input read once and each output written once;
% roof is against the 4247 GB/s device copy. Targets: staging T=8192 G=32 >= 80 % of roof; the expert-id
kernels <= 2x the 1.08 us graph-replay launch floor when small and near the roof when large.
Table 2 (tune): staging at T=8192 H=7168 G=32 under other (values per program, num_warps) launch shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton loads

import torch  # noqa: E402
from gpu_common import BYTE_ROOF as COPY_ROOF  # noqa: E402 (puts the repo on sys.path)
from gpu_common import env_line, time_events, time_graph  # noqa: E402

from moebench.check import compare_exact, poison  # noqa: E402
from moebench.kernels.apply_expert_map import apply_expert_map, apply_expert_map_torch, build_expert_map  # noqa: E402
from moebench.kernels.globalize_recv_topk_idx import (globalize_recv_topk_idx,  # noqa: E402
                                                      globalize_recv_topk_idx_torch, make_receive_buffer)
from moebench.kernels.prepare_moe_inputs import (DEFAULT_ELEMS_PER_PROGRAM, DEFAULT_NUM_WARPS,  # noqa: E402
                                                 alloc_outputs, compare_staging, prepare_moe_inputs,
                                                 prepare_moe_inputs_oblivious, prepare_moe_inputs_torch)

LAUNCH_FLOOR_US = 1.08  # empty kernel, CUDA-graph replay
CALLS_PER_GRAPH = 20
REPLAYS = 15


def time_graph_call(fn, device) -> float:
    """Median us per call: CALLS_PER_GRAPH calls captured in one graph, REPLAYS replays timed with events.
    No events fallback: every kernel here must be capturable. CPU: one wall-clock call (the check ran it)."""
    return time_graph(fn, device, CALLS_PER_GRAPH, REPLAYS, fallback=False, cpu_warmup=0)[0]


ROWS: list[tuple] = []


def report(name: str, shape: str, ok: bool, detail: str, us: float | None, nbytes: int, note: str = "") -> None:
    gbs = nbytes / (us * 1e-6) / 1e9 if us else float("nan")
    ROWS.append((name, shape, "ok" if ok else "WRONG", us, gbs, 100 * gbs * 1e9 / COPY_ROOF if us else float("nan"),
                 note))
    if not ok:
        print(f"# WRONG {name} {shape}: {detail}", flush=True)


def staging_inputs(T, H, K, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    topk_weights = torch.rand(T, K, generator=g, device=device)
    topk_ids = torch.randint(0, 256, (T, K), generator=g, device=device, dtype=torch.int32)
    is_padding = torch.zeros(T, dtype=torch.bool, device=device)
    is_padding[T - T // 4:] = True
    return hidden, topk_weights, topk_ids, is_padding


def staging_bytes(T, H, K, G, fmt, masked=True):
    sf = T * H // (4 * G) * 4 if fmt == "ue8m0_packed" else T * H // G * 4
    return 2 * T * H + T * H + sf + T * K * (4 + 4) + (T if masked else 0) + T * K * (8 + 4)


def bench_staging(T, H, K, G, fmt, device, *, oblivious=False, tune=None, label=None):
    hidden, topk_weights, topk_ids, is_padding = staging_inputs(T, H, K, device, seed=T + G)
    outs = alloc_outputs(T, H, K, G, fmt, device)
    fn = prepare_moe_inputs_oblivious if oblivious else prepare_moe_inputs
    for t in outs:
        poison(t)
    fn(hidden, topk_weights, topk_ids, is_padding, G, fmt, out=outs, tune=tune)
    ref = prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, None if oblivious else is_padding, G, fmt)
    res = compare_staging(outs, ref, bitwise=device.type == "cuda")
    del ref
    us = None
    if res.ok:
        us = time_graph_call(lambda: fn(hidden, topk_weights, topk_ids, is_padding, G, fmt, out=outs, tune=tune),
                             device)
    name = label or ("prepare_moe_inputs.oblivious" if oblivious else "prepare_moe_inputs.triton")
    report(name, f"T={T} H={H} K={K} G={G} {fmt}", res.ok, res.detail, us,
           staging_bytes(T, H, K, G, fmt, masked=not oblivious),
           f"tune={tune}" if tune else "")
    return us


def bench_staging_reference(T, H, K, G, device):
    hidden, topk_weights, topk_ids, is_padding = staging_inputs(T, H, K, device)
    us = time_events(lambda: prepare_moe_inputs_torch(hidden, topk_weights, topk_ids, is_padding, G), device, 10,
                     warmup=1)
    report("prepare_moe_inputs.torch", f"T={T} H={H} K={K} G={G} ue8m0_packed", True, "", us,
           staging_bytes(T, H, K, G, "ue8m0_packed"), "eager, events")


def bench_expert_map(T, K, device, E=256, ep_size=8):
    g = torch.Generator(device="cpu").manual_seed(T)
    topk_ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32).to(device)
    expert_map = build_expert_map(E, ep_size, ep_size - 1, generator=g, device=device)
    out = poison(torch.empty(T, K, dtype=torch.int64, device=device))
    apply_expert_map(topk_ids, expert_map, out=out)
    res = compare_exact("local_ids", out, apply_expert_map_torch(topk_ids, expert_map))
    us = time_graph_call(lambda: apply_expert_map(topk_ids, expert_map, out=out), device) if res.ok else None
    report("apply_expert_map.triton", f"T={T} K={K} E={E}", res.ok, res.detail, us, T * K * (4 + 8) + E * 4,
           f"{us / LAUNCH_FLOOR_US:.2f}x launch floor" if us and T * K < 4096 else "")


def bench_globalize(T, K, device, E=256, ep_size=8):
    g = torch.Generator(device="cpu").manual_seed(T + 1)
    local_experts = E // ep_size
    num_recv = T * 5 // 8
    local = torch.randint(-1, local_experts, (num_recv, K), generator=g)
    source, n = make_receive_buffer(local, T, local_experts, generator=g)
    source, n = source.to(device), n.to(device)
    offset = (ep_size - 1) * local_experts
    buf = source.clone()
    globalize_recv_topk_idx(buf, n, offset, E)
    res = compare_exact("recv_topk_idx", buf, globalize_recv_topk_idx_torch(source.clone(), n, offset, E))
    us = time_graph_call(lambda: globalize_recv_topk_idx(buf, n, offset, E), device) if res.ok else None
    report("globalize_recv_topk_idx.triton", f"N={T} K={K} num_recv={num_recv}", res.ok, res.detail, us,
           2 * T * K * 8 + 4, f"{us / LAUNCH_FLOOR_US:.2f}x launch floor" if us and T * K < 4096 else "")


def print_table(title: str) -> None:
    print(f"\n# {title}")
    print(f"{'impl':<32} {'shape':<42} {'check':<6} {'us':>9} {'GB/s':>8} {'%roof':>6}  note")
    for name, shape, status, us, gbs, pct, note in ROWS:
        us_s = f"{us:9.2f}" if us else f"{'-':>9}"
        print(f"{name:<32} {shape:<42} {status:<6} {us_s} {gbs:8.0f} {pct:6.1f}  {note}")
    ROWS.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the Triton interpreter")
    ap.add_argument("--no-tune", action="store_true", help="skip the staging launch-shape sweep")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-smoke to exercise the script on the CPU)")
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    H = 512 if args.cpu_smoke else 7168
    tokens = (1, 4, 16) if args.cpu_smoke else (1, 128, 8192, 32768)
    big_T = 16 if args.cpu_smoke else 8192
    t_start = time.time()
    if device.type == "cuda":
        print(env_line(device))
    print(f"# default staging launch: {DEFAULT_ELEMS_PER_PROGRAM} values/program, {DEFAULT_NUM_WARPS} warps; "
          f"{CALLS_PER_GRAPH} calls per graph, median of {REPLAYS} replays", flush=True)

    for G in (32, 128):
        for T in tokens:
            bench_staging(T, H, 8, G, "ue8m0_packed", device)
        bench_staging(big_T, H, 8, G, "fp32", device)
    bench_staging(big_T, H, 8, 32, "ue8m0_packed", device, oblivious=True)
    bench_staging(big_T, 512 * 3 if not args.cpu_smoke else 1536, 6, 128, "ue8m0_packed", device)  # odd K, H
    bench_staging_reference(big_T, H, 8, 32, device)
    for T in ((64, 65536) if not args.cpu_smoke else (64, 300)):
        bench_expert_map(T, 8, device)
        bench_globalize(T, 8, device)
    print_table("staging and expert-id kernels")

    if not args.no_tune:
        for tune in ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8)):
            bench_staging(big_T, H, 8, 32, "ue8m0_packed", device, tune=tune)
        print_table(f"staging launch shapes, T={big_T} H={H} G=32 (values per program, num_warps)")
    print(f"\n# done in {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
