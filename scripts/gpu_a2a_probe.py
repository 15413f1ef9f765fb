#!/usr/bin/env python3
"""What an exact-split all-to-all dispatch can reach on this machine: host launch costs, the host clock inside one
a2a dispatch call, and the wire's variants. No sweep can say these: they time pieces of a call, not a call.

    python3 scripts/gpu_a2a_probe.py            # 2 GPUs, NCCL; about 30 s
    python3 scripts/gpu_a2a_probe.py --cpu-smoke   # the script's own logic on 2 gloo CPU ranks, tiny shapes

Per rank, the dispatch target's shape (4096 tokens, H=7168 bf16, top-8 of 256 experts, uniform routing):
  host   : host microseconds per launch call, the GPU left to run behind it (moebench.measure.timing.host_call_us,
           median of 200) of a small torch op, an event record, the Triton send plan and pack, a tiny NCCL
           all_to_all_single, a one-node graph replay; and a count exchange's round trip to the host (all_to_all of
           the counts, copy to pinned memory, event wait).
  kernel : GPU microseconds per call of the plan (two launches) and the pack: 20 calls captured in one CUDA graph,
           replayed (moebench.measure.timing.measure, cuda_graph mode).
  a2a    : the host clock and the GPU inside A2APath.dispatch (graph mode), us since the call, median of 30 calls
           after a barrier: the StageTimer marks (pre-payload graph replayed, counts on the host, payload
           all_to_all launched, return); where the host spends the time between the call and the payload's launch.
  wire   : NCCL all_to_all_single of the step's rows (medians of 30, per-iteration max over ranks):
           `all`: every destination's rows, own rank's included (the raw baseline of gpu_dispatch.py);
           `remote`: own rank's split 0 (only what crosses NVLink); `remote+own copy`: the same with the own rows
           copied on a second stream meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (here and in the spawned ranks)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for `moebench`

import torch  # noqa: E402

from moebench.run import dist as mdist  # noqa: E402
from moebench.report.table import print_rows  # noqa: E402
from moebench.run.results import environment  # noqa: E402


def worker(ctx) -> dict:
    import torch.distributed as dist

    from moebench import inputs
    from moebench.dispatch.a2a import A2APath
    from moebench.dispatch.base import EPLayout, StageTimer, token_in_rank
    from moebench.dispatch.comm import all_to_all_single
    from moebench.dispatch.pack import pack_fixed
    from moebench.dispatch.permute import RowLayout, plan_scratch, plan_sends
    from moebench.measure.timing import host_call_us, marked_calls, measure
    from moebench.params import Params, Timing

    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    cuda = dev.type == "cuda"
    T, H, E, K = (32, 64, 16, 4) if CPU_SMOKE else (4096, 7168, 256, 8)
    host_iters, iters = (5, 3) if CPU_SMOKE else (200, 30)
    p = Params(num_tokens=T, hidden=H, num_experts=E, top_k=K, routing="uniform", ep_size=R)
    batch = inputs.make_batch(p, dev, seed_offset=rank)
    w, ids = inputs.route(p, batch)
    x = batch.hidden
    lay = EPLayout(rank, R, E, ctx.group)
    rows = RowLayout(H, K, x.dtype)
    send_pos = torch.empty(T, R, dtype=torch.int32, device=dev)
    counts = torch.empty(R, dtype=torch.int32, device=dev)
    offsets = torch.empty(R, dtype=torch.int32, device=dev)
    send_buf = rows.empty(T * R, dev)
    scratch = plan_scratch(T, K, R, dev)
    sx, sm = rows.x(send_buf), rows.meta(send_buf)

    def plan():
        plan_sends(ids, None, lay.local_experts, R, E, send_pos=send_pos, counts=counts, offsets=offsets,
                   block_counts=scratch)

    def pack():
        pack_fixed(x, send_pos, ids, w, sx, sm, 0, lay.local_experts, offsets=offsets)

    small = torch.zeros(256, device=dev)
    c_in = torch.ones(R, dtype=torch.int32, device=dev)
    c_out = torch.empty_like(c_in)
    pinned = torch.empty(R, dtype=torch.int32, pin_memory=cuda)
    ev = torch.cuda.Event() if cuda else None

    def count_trip():
        all_to_all_single(c_out, c_in, group=ctx.group, world_size=R)
        pinned.copy_(c_out, non_blocking=cuda)
        if ev is not None:
            ev.record()
            ev.synchronize()

    out = {"rank": rank, "host_us": {}, "kernel_us": {}, "a2a": [], "wire_us": {}}
    out["host_us"]["torch small add_"] = host_call_us(lambda: small.add_(1), dev, host_iters)
    if ev is not None:
        out["host_us"]["event record"] = host_call_us(ev.record, dev, host_iters)
    out["host_us"]["triton plan_sends"] = host_call_us(plan, dev, host_iters)
    out["host_us"]["triton pack_fixed"] = host_call_us(pack, dev, host_iters)
    out["host_us"]["nccl a2a 2 ints"] = host_call_us(
        lambda: all_to_all_single(c_out, c_in, group=ctx.group, world_size=R), dev, host_iters)
    dist.barrier(group=ctx.group)
    out["host_us"]["count trip (a2a + D2H + wait)"] = host_call_us(count_trip, dev, max(1, host_iters // 2))
    if cuda:
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            small.add_(1)
        out["host_us"]["graph replay (1 node)"] = host_call_us(g1.replay, dev, host_iters)
        graph_timing = Timing(mode="cuda_graph", warmup=1, iters=10, unroll=20, max_seconds=float("inf"))
        out["kernel_us"]["plan_sends"] = measure(plan, graph_timing, dev).stats["p50"]
        out["kernel_us"]["pack_fixed"] = measure(pack, graph_timing, dev).stats["p50"]

    path = A2APath(lay, hidden=H, top_k=K, device=dev)
    for _ in range(3):  # the first calls run eagerly and capture the pre-payload graph
        path.dispatch(x, ids, w, None)
    path.timer = StageTimer(dev)
    try:
        out["a2a"] = marked_calls(lambda: path.dispatch(x, ids, w, None), path.timer, iters, dev, group=ctx.group)
    finally:
        path.timer = None
        path.close()

    in_rank = token_in_rank(ids, lay)
    send_counts = in_rank.sum(0, dtype=torch.int32)
    recv_counts = torch.empty_like(send_counts)
    all_to_all_single(recv_counts, send_counts, group=ctx.group, world_size=R)
    ss, rs = send_counts.tolist(), recv_counts.tolist()
    send_x = torch.randn(sum(ss), H, dtype=x.dtype, device=dev)
    recv_x = torch.empty(sum(rs), H, dtype=x.dtype, device=dev)
    own_ss = [0 if d == rank else s for d, s in enumerate(ss)]
    own_rs = [0 if d == rank else s for d, s in enumerate(rs)]
    own_off_s = sum(ss[:rank])
    remote_send = torch.cat([send_x[:own_off_s], send_x[own_off_s + ss[rank]:]])
    remote_recv = torch.empty(sum(own_rs), H, dtype=x.dtype, device=dev)
    own_dst = torch.empty(ss[rank], H, dtype=x.dtype, device=dev)
    side = torch.cuda.Stream() if cuda else None
    timing = Timing(mode="events", warmup=5 if cuda else 1, iters=iters, max_seconds=float("inf"))

    def a2a_all():
        all_to_all_single(recv_x, send_x, rs, ss, group=ctx.group, world_size=R)

    def a2a_remote():
        all_to_all_single(remote_recv, remote_send, own_rs, own_ss, group=ctx.group, world_size=R)

    def a2a_remote_own():
        if side is None:
            own_dst.copy_(send_x[own_off_s:own_off_s + ss[rank]])
            return a2a_remote()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            own_dst.copy_(send_x[own_off_s:own_off_s + ss[rank]])
        a2a_remote()
        torch.cuda.current_stream().wait_stream(side)

    for name, fn, nbytes in (("all", a2a_all, recv_x.numel() * 2), ("remote", a2a_remote, remote_recv.numel() * 2),
                             ("remote+own copy", a2a_remote_own, recv_x.numel() * 2)):
        res = measure(fn, timing, dev, group=ctx.group, barrier=True)
        out["wire_us"][name] = (res.stats["p50"], nbytes)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="2 gloo CPU ranks, tiny shapes, interpreter")
    ap.parse_args()
    if not CPU_SMOKE and torch.cuda.device_count() < 2:
        print("needs 2 GPUs (or --cpu-smoke)", file=sys.stderr)
        return 2
    res = mdist.spawn(worker, 2, backend="gloo" if CPU_SMOKE else "nccl", timeout_s=300)
    env = environment()
    print(f"# torch {env['torch']}, nccl {env.get('nccl') or '-'}, {env.get('gpu') or 'cpu (gloo, interpreter)'}")
    table = []
    for r in res:
        table += [[r["rank"], "host", k, v] for k, v in r["host_us"].items()]
        table += [[r["rank"], "kernel", k, v] for k, v in r["kernel_us"].items()]
        table += [[r["rank"], "a2a host", pt["label"], pt["host_us"]] for pt in r["a2a"]]
        table += [[r["rank"], "a2a gpu", pt["label"], pt["gpu_us"]] for pt in r["a2a"] if pt["gpu_us"] is not None]
    print_rows(["rank", "what", "step", "us"], table)
    print_rows(["wire (rank 0 bytes)", "us", "MB", "GB/s"],
               [[k, us, nbytes / 1e6, nbytes / us / 1e3] for k, (us, nbytes) in res[0]["wire_us"].items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
