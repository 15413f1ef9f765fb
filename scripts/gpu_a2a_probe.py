#!/usr/bin/env python3
"""What an exact-split all-to-all dispatch can reach on this machine: host launch costs and the wire's variants.

    python3 scripts/gpu_a2a_probe.py            # 2 GPUs, NCCL; about 30 s

Per rank, the dispatch target's shape (4096 tokens, H=7168 bf16, top-8 of 256 experts, uniform routing):
  host   : host microseconds per launch call (median of 200, no sync in between) of a small torch op, the Triton
           send plan, the Triton pack, a tiny NCCL all_to_all_single, an event record; and a count exchange's
           round trip to the host (all_to_all of the counts, copy to pinned memory, event wait).
  kernel : GPU microseconds per call of the plan (two launches) and the pack (20 calls in a CUDA graph, replayed).
  wire   : NCCL all_to_all_single of the step's rows (medians of 30, per-iteration max over ranks):
           `all`: every destination's rows, own rank's included (the raw baseline of gpu_dispatch.py);
           `remote`: own rank's split 0 (only what crosses NVLink); `remote+own copy`: the same with the own rows
           copied on a second stream meanwhile.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import gpu_common  # noqa: F401 (puts the repo root on sys.path)

from moebench import dist as mdist


def _host_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples)


def _kernel_us(fn, n: int = 20) -> float:
    """GPU time per call: n calls captured in one CUDA graph, replayed (host launch costs out of the picture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(10):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(samples)


def worker(ctx):
    import torch.distributed as dist

    from moebench import inputs
    from moebench.dispatch.base import EPLayout, token_in_rank
    from moebench.dispatch.comm import all_to_all_single
    from moebench.dispatch.pack import pack_fixed
    from moebench.dispatch.permute import RowLayout, plan_scratch, plan_sends
    from moebench.measure.timing import measure
    from moebench.sweep import Params, Timing

    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    p = Params(num_tokens=4096, hidden=7168, num_experts=256, top_k=8, routing="uniform", ep_size=R)
    batch = inputs.make_batch(p, dev, seed_offset=rank)
    w, ids = inputs.route(p, batch)
    x = batch.hidden
    T, H = x.shape
    lay = EPLayout(rank, R, 256, ctx.group)
    rows = RowLayout(H, 8, x.dtype)
    send_pos = torch.empty(T, R, dtype=torch.int32, device=dev)
    counts = torch.empty(R, dtype=torch.int32, device=dev)
    offsets = torch.empty(R, dtype=torch.int32, device=dev)
    send_buf = rows.empty(T * R, dev)
    scratch = plan_scratch(T, 8, R, dev)
    sx, sm = rows.x(send_buf), rows.meta(send_buf)

    def plan():
        plan_sends(ids, None, lay.experts_per_rank, R, 256, send_pos=send_pos, counts=counts, offsets=offsets,
                   block_counts=scratch)

    def pack():
        pack_fixed(x, send_pos, ids, w, sx, sm, 0, lay.experts_per_rank, offsets=offsets)

    small = torch.zeros(256, device=dev)
    c_in = torch.ones(R, dtype=torch.int32, device=dev)
    c_out = torch.empty_like(c_in)
    pinned = torch.empty(R, dtype=torch.int32, pin_memory=True)
    ev = torch.cuda.Event()

    def count_trip():
        all_to_all_single(c_out, c_in, group=ctx.group, world_size=R)
        pinned.copy_(c_out, non_blocking=True)
        ev.record()
        ev.synchronize()

    out = {"rank": rank, "host_us": {}, "kernel_us": {}, "wire_us": {}}
    out["host_us"]["torch small add_"] = _host_us(lambda: small.add_(1))
    out["host_us"]["event record"] = _host_us(lambda: ev.record())
    out["host_us"]["triton plan_sends"] = _host_us(plan)
    out["host_us"]["triton pack_fixed"] = _host_us(pack)
    out["host_us"]["nccl a2a 2 ints"] = _host_us(lambda: all_to_all_single(c_out, c_in, group=ctx.group,
                                                                             world_size=R))
    dist.barrier(group=ctx.group)
    out["host_us"]["count trip (a2a + D2H + wait)"] = _host_us(count_trip, 100)
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        small.add_(1)
    out["host_us"]["graph replay (1 node)"] = _host_us(g1.replay)
    out["kernel_us"]["plan_sends"] = _kernel_us(plan)
    out["kernel_us"]["pack_fixed"] = _kernel_us(pack)

    in_rank = token_in_rank(ids, lay)
    send_counts = in_rank.sum(0, dtype=torch.int32)
    recv_counts = torch.empty_like(send_counts)
    all_to_all_single(recv_counts, send_counts, group=ctx.group, world_size=R)
    ss, rs = send_counts.tolist(), recv_counts.tolist()
    send_x = torch.randn(sum(ss), H, dtype=x.dtype, device=dev)
    recv_x = torch.empty(sum(rs), H, dtype=x.dtype, device=dev)
    own_ss = [0 if d == rank else s for d, s in enumerate(ss)]
    own_rs = [0 if d == rank else s for d, s in enumerate(rs)]
    own_off_s, own_off_r = sum(ss[:rank]), sum(rs[:rank])
    remote_send = torch.cat([send_x[:own_off_s], send_x[own_off_s + ss[rank]:]])
    remote_recv = torch.empty(sum(own_rs), H, dtype=x.dtype, device=dev)
    own_dst = torch.empty(ss[rank], H, dtype=x.dtype, device=dev)
    side = torch.cuda.Stream()
    timing = Timing(mode="events", warmup=5, iters=30, max_seconds=float("inf"))

    def a2a_all():
        all_to_all_single(recv_x, send_x, rs, ss, group=ctx.group, world_size=R)

    def a2a_remote():
        all_to_all_single(remote_recv, remote_send, own_rs, own_ss, group=ctx.group, world_size=R)

    def a2a_remote_own():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            own_dst.copy_(send_x[own_off_s:own_off_s + ss[rank]])
        a2a_remote()
        torch.cuda.current_stream().wait_stream(side)

    out["a2a_host"] = _a2a_host_breakdown(ctx, lay, x, ids, w)
    for name, fn, nbytes in (("all", a2a_all, recv_x.numel() * 2), ("remote", a2a_remote, remote_recv.numel() * 2),
                             ("remote+own copy", a2a_remote_own, recv_x.numel() * 2)):
        res = measure(fn, timing, dev, group=ctx.group, barrier=True)
        out["wire_us"][name] = (res.stats["p50"], nbytes)
    return out


def _a2a_host_breakdown(ctx, lay, x, ids, w, iters: int = 30) -> dict:
    """Host clock inside A2APath.dispatch (graph mode), us since the call, median of `iters` calls after a barrier:
    where the host spends the time between the call and the payload's launch."""
    import torch.distributed as dist

    import moebench.dispatch.a2a as a2a_mod

    path = a2a_mod.A2APath(lay, hidden=x.shape[1], top_k=ids.shape[1], device=x.device)
    for _ in range(3):
        path.dispatch(x, ids, w, None)
    torch.cuda.synchronize()
    marks: dict[str, list[float]] = {}
    t0 = [0.0]

    def mark(name):
        marks.setdefault(name, []).append((time.perf_counter() - t0[0]) * 1e6)

    class Replay:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            mark("replay enter")
            self.graph.replay()
            mark("replay exit")

    class Counts:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            mark("wait counts enter")
            self.event.synchronize()
            mark("wait counts exit")

    graph_for, event, a2a = path._graph_for, path.counts_ready_graph, a2a_mod.all_to_all_single

    def timed_graph_for(*a, **k):
        mark("graph lookup enter")
        return Replay(graph_for(*a, **k))

    def timed_a2a(*a, **k):
        mark("payload call enter")
        a2a(*a, **k)
        mark("payload call exit")

    path._graph_for, path.counts_ready_graph, a2a_mod.all_to_all_single = timed_graph_for, Counts(event), timed_a2a
    gpu = []
    try:
        for _ in range(iters):
            dist.barrier(group=ctx.group)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0[0] = time.perf_counter()
            path.dispatch(x, ids, w, None)
            mark("return")
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
    finally:
        path._graph_for, path.counts_ready_graph, a2a_mod.all_to_all_single = graph_for, event, a2a
    res = {k: statistics.median(v) for k, v in marks.items()}
    res["GPU end (events)"] = statistics.median(gpu)
    return res


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    res = mdist.spawn(worker, 2, backend="nccl", timeout_s=300)
    print(f"# torch {torch.__version__}, nccl {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(0)}")
    for r in res:
        print(f"## rank {r['rank']}")
        for k, v in r["host_us"].items():
            print(f"  host   {k:<34} {v:8.1f} us")
        for k, v in r["kernel_us"].items():
            print(f"  kernel {k:<34} {v:8.1f} us")
        for k, v in r["a2a_host"].items():
            print(f"  a2a dispatch host: {k:<25} {v:8.1f} us since the call")
    for k, (us, nbytes) in res[0]["wire_us"].items():
        print(f"  wire   {k:<34} {us:8.1f} us  {nbytes / 1e6:7.2f} MB  {nbytes / us / 1e3:6.1f} GB/s (rank 0 bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
