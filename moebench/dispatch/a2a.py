"""`a2a`: exact-size all-to-all.

Dispatch, one step:
  1. `plan_sends` (two Triton launches): each (row, destination) pair's slot, the rows per destination and where
     each destination's block starts (exclusive prefix), all on the device; padded rows go nowhere when masked.
  2. The pack kernel writes every row once per destination, its routing (ids made local to that destination,
     weights, source row) in the same wire row (moebench.dispatch.permute.RowLayout), straight into the
     preallocated send buffer; meanwhile
  3. on a side stream that waits for the plan only, the count exchange (one tiny all_to_all) and its copy to
     pinned host memory (in the captured graph: before the pack, in stream order; see _graph_for).
  4. The host waits for the counts (the one host synchronisation this path has), then ONE all_to_all_single with
     exact split sizes moves rows and routing together. The receiver gets views into its receive buffer: nothing
     to unpack, the ids are already local.
On a GPU, steps 1-3 are captured once per input signature (tensor addresses, shapes, strides, dtypes) as one CUDA
graph and replayed: one launch instead of five or six, each costing the host tens of microseconds, and the host
is on this path's critical path (it must read the counts before it can launch the
payload). The counts' arrival is an external event recorded inside the graph, so the host waits for the count
exchange only, not for the pack. Replaying a graph on the same addresses reads whatever those tensors hold now,
so a new batch in the same buffers (what a serving engine does) needs no new capture. `graph=False` runs the
steps eagerly. A miss in the graph cache runs the step eagerly (kernels must compile and load before a capture)
and that eager run IS the step: its counts size the payload, and the graph captured after it is kept for the next
steps, not replayed now. So every step runs exactly one count exchange on every rank, whether it hit or missed,
and a rank that misses while another hits still pairs its count exchange with theirs (see GraphCache).
Combine: one all_to_all_single of the expert outputs back (reversed splits), then one kernel sums each row's
partial outputs by (row, destination) slot, in destination order: deterministic, no atomics, no zero-fill.

Buffers are kept from call to call and only grow (send: T*min(ep_size, K) rows, the most a step can send; receive and
combine: the largest step seen), so a steady-state step allocates nothing; growing a send-side buffer drops the
captured graphs (they hold its old address).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from moebench.dispatch.base import Dispatched, DispatchPath, EPLayout, ReceivedRows, dispatch_path
from moebench.dispatch.comm import SideStream, all_to_all_single, grow_rows, triton_default
from moebench.dispatch.pack import combine_fixed, combine_fixed_torch, pack_fixed, pack_fixed_torch
from moebench.dispatch.permute import RowLayout, plan_scratch, run_plan
from moebench.kernels.contract import check_mask


@dataclass
class A2AHandle:
    send_pos: torch.Tensor  # int32 [T, ep_size]: row t's position in destination d's block, -1 = not sent
    offsets: torch.Tensor  # int32 [ep_size]: where destination d's block starts in the send buffer
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int
    recv_src_row: torch.Tensor  # int32 [N]: row index on its source rank


def destination_order(in_rank: torch.Tensor, num_sent: int) -> torch.Tensor:
    """Rows to send, grouped by destination rank (ascending row within a destination), as a gather index
    (torch; scripts/gpu_dispatch.py's raw baseline pre-permutes its rows with it).

    Sync-free: the slot of each (dest, row) pair is a running count in destination-major order; pairs that are
    not sent are scattered to a dump slot past the end.
    """
    T, ep_size = in_rank.shape
    flat = in_rank.t().reshape(-1)  # [ep_size*T], destination-major
    slot = torch.cumsum(flat, 0) - 1
    target = torch.where(flat, slot, torch.full_like(slot, num_sent))
    rows = torch.arange(ep_size * T, device=in_rank.device) % T
    index = torch.empty(num_sent + 1, dtype=torch.int64, device=in_rank.device)
    index.scatter_(0, target, rows)
    return index[:num_sent]


def _signature(t: torch.Tensor | None) -> tuple | None:
    """What a captured graph depends on: the address and the layout (a graph replays on whatever is there)."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


class GraphCache:
    """Captured graphs by key (least recently used dropped past `max_graphs`).

    `lookup(key, eager, capture)`: on a hit returns the graph, for the caller to replay as this step; on a miss
    runs `eager()`, which does this step, then stores `capture()` (the graph, recorded but not run) for later steps
    and returns None. Never both on one step: the step's collectives run once whether it hit or missed, so ranks
    that hit and ranks that miss on the same step still pair their collectives (a replay after the eager run would
    run the count exchange twice on the missing rank, pairing its second one with the other ranks' next step)."""

    def __init__(self, max_graphs: int):
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    def lookup(self, key: Hashable, eager: Callable[[], None], capture: Callable[[], Any]) -> Any | None:
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        eager()
        self._graphs[key] = capture()
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return None


@dispatch_path("a2a", description="count exchange (host sync), permute by destination, exact-size "
                                   "all_to_all_single; scatter-sum back")
class A2APath(DispatchPath):
    receives = "token"
    graph_capturable = False  # the split sizes are read back on the host

    MAX_GRAPHS = 16  # captured pre-payload graphs kept (least recently used dropped first)

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", use_triton: bool | None = None, graph: bool | None = None):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        self.use_triton = triton_default(self.device) if use_triton is None else use_triton
        self.graph = (self.device.type == "cuda" and self.use_triton) if graph is None else graph
        if self.graph and self.device.type != "cuda":
            raise ValueError("a2a: graph=True needs a CUDA device")
        self.rows = RowLayout(hidden, top_k, dtype)
        ep_size, dev = layout.ep_size, self.device
        cuda = dev.type == "cuda"
        self.counts = torch.zeros(2, ep_size, dtype=torch.int32, device=dev)  # [0]: sent per destination, [1]: received
        self.offsets = torch.zeros(ep_size, dtype=torch.int32, device=dev)
        self.host_counts = torch.zeros(2, ep_size, dtype=torch.int32, pin_memory=cuda)
        self.counts_ready = torch.cuda.Event() if cuda else None
        # recorded inside the captured graph, waited on by the host: cudaEventRecordExternal
        self.counts_ready_graph = torch.cuda.Event(external=True) if self.graph else None
        self.side = SideStream(dev)
        self.graphs = GraphCache(self.MAX_GRAPHS)  # the captured pre-payload stages
        self.send_pos: torch.Tensor | None = None
        self.plan_scratch: torch.Tensor | None = None
        self.send_buf: torch.Tensor | None = None
        self.recv_buf: torch.Tensor | None = None
        self.back: torch.Tensor | None = None
        self._send_views: tuple[torch.Tensor, ...] = ()
        self._recv_views: tuple[torch.Tensor, ...] = ()

    def _reserve(self, T: int, dev: torch.device) -> None:
        """Grow the send-side buffers to a step of T rows; the dtype views are made once per buffer (each costs
        microseconds of host time, and the host is on this path's critical path before the payload launch)."""
        ep_size, K = self.layout.ep_size, self.top_k
        send_pos = grow_rows(self.send_pos, T, lambda n: torch.empty(n, ep_size, dtype=torch.int32, device=dev))
        buf = grow_rows(self.send_buf, T * min(ep_size, K), lambda n: self.rows.empty(n, dev))
        if send_pos is not self.send_pos:
            self.send_pos = send_pos
            self.plan_scratch = plan_scratch(send_pos.shape[0], K, ep_size, dev)
            self.graphs.clear()
        if buf is not self.send_buf:
            self.send_buf = buf
            self._send_views = (self.rows.x(buf), self.rows.meta(buf))
            self.graphs.clear()

    def _reserve_recv(self, N: int, dev: torch.device) -> None:
        buf = grow_rows(self.recv_buf, N, lambda n: self.rows.empty(n, dev))
        if buf is not self.recv_buf:
            self.recv_buf = buf
            self._recv_views = (self.rows.x(buf), self.rows.ids(buf), self.rows.weights(buf), self.rows.src_row(buf))

    def _pre_payload(self, x, topk_ids, topk_weights, is_padding, T: int, record) -> None:
        """Plan, then the pack on this stream and the count exchange (+ its copy to the host, then `record`) on
        the side stream beside it. The caller joins the side stream."""
        lay: EPLayout = self.layout
        send_pos = self.send_pos[:T]
        run_plan(self.use_triton, topk_ids, is_padding, lay, 0, send_pos, self.counts[0], self.offsets,
                 block_counts=self.plan_scratch)
        self._mark("plan")
        self.side.fork_here()
        # the pack first (it is the longer job), then the count exchange and its trip to the host beside it
        pack = pack_fixed if self.use_triton else pack_fixed_torch
        send_x, send_meta = self._send_views
        pack(x, send_pos, topk_ids, topk_weights, send_x, send_meta, 0, lay.local_experts, offsets=self.offsets)
        self._mark("pack")
        with self.side.run():
            all_to_all_single(self.counts[1], self.counts[0], group=lay.group, world_size=lay.ep_size)
            if record is not None:
                self.host_counts.copy_(self.counts, non_blocking=True)
                record.record()
            self._mark("count_exchange")

    def _graph_for(self, x, topk_ids, topk_weights, is_padding, T: int) -> torch.cuda.CUDAGraph | None:
        """The captured pre-payload stage for these inputs' addresses and layouts, to replay as this step (a hit).
        None on a miss: the step has then run eagerly (its counts are on the host) and the graph captured after
        it waits for the next steps (GraphCache: one count exchange per step either way)."""
        key = (_signature(x), _signature(topk_ids), _signature(topk_weights), _signature(is_padding))
        return self.graphs.lookup(key, eager=lambda: self._eager_step(x, topk_ids, topk_weights, is_padding, T),
                                  capture=lambda: self._capture(x, topk_ids, topk_weights, is_padding, T))

    def _eager_step(self, x, topk_ids, topk_weights, is_padding, T: int) -> None:
        """The pre-payload stage run eagerly to its end, counts on the host. It also compiles and loads the
        kernels, which must not happen during a capture."""
        self._pre_payload(x, topk_ids, topk_weights, is_padding, T, record=self.counts_ready)
        self.side.join()
        torch.cuda.current_stream(self.device).synchronize()

    def _capture(self, x, topk_ids, topk_weights, is_padding, T: int) -> torch.cuda.CUDAGraph:
        """The pre-payload stage as one CUDA graph (recorded, not run)."""
        timer, self.timer = self.timer, None  # timing events cannot be captured
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: the process group's watchdog thread keeps querying its events during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run_plan(True, topk_ids, is_padding, self.layout, 0, self.send_pos[:T], self.counts[0],
                         self.offsets, block_counts=self.plan_scratch)
                # The count exchange and its trip to the host come before the pack, in stream order: on a branch
                # beside the pack, the tiny NCCL kernel found every SM taken by the pack's blocks and finished
                # only after it, delaying the host's counts. The host needs the counts first; the pack is done
                # long before the host has launched the payload.
                all_to_all_single(self.counts[1], self.counts[0], group=self.layout.group,
                                  world_size=self.layout.ep_size)
                self.host_counts.copy_(self.counts, non_blocking=True)
                self.counts_ready_graph.record()
                send_x, send_meta = self._send_views
                pack_fixed(x, self.send_pos[:T], topk_ids, topk_weights, send_x, send_meta, 0,
                           self.layout.local_experts, offsets=self.offsets)
        finally:
            self.timer = timer
        return graph

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay: EPLayout = self.layout
        ep_size = lay.ep_size
        T, K = topk_ids.shape
        check_mask(is_padding, T)
        dev = x.device
        self._reserve(T, dev)
        if self.graph:  # nothing else before the replay: the host is on the critical path until the payload
            graph = self._graph_for(x, topk_ids, topk_weights, is_padding, T)
            if graph is not None:  # a hit; on a miss the eager run was this step
                graph.replay()
                self._mark("pre_payload_graph")
                self.counts_ready_graph.synchronize()  # the host sync: split sizes for the payload
            send_splits, recv_splits = self.host_counts.tolist()
        else:
            self._pre_payload(x, topk_ids, topk_weights, is_padding, T, record=self.counts_ready)
            if self.counts_ready is not None:
                self.counts_ready.synchronize()  # the host sync: split sizes for the payload
                send_splits, recv_splits = self.host_counts.tolist()
            else:
                send_splits, recv_splits = self.counts.tolist()
            self.side.join()
        self._mark("counts_on_host")
        S, N = sum(send_splits), sum(recv_splits)
        self._reserve_recv(N, dev)
        all_to_all_single(self.recv_buf[:N], self.send_buf[:S], recv_splits, send_splits, group=lay.group,
                          world_size=ep_size)
        self._mark("payload_a2a")
        recv_x, recv_ids, recv_w, recv_src = (v[:N] for v in self._recv_views)
        handle = A2AHandle(self.send_pos[:T], self.offsets, send_splits, recv_splits, T, recv_src)
        return Dispatched(recv_x=recv_x, recv_topk_ids=recv_ids, recv_topk_weights=recv_w, num_recv=N,
                          handle=handle, send_counts=send_splits, recv_counts=recv_splits)

    def combine(self, expert_out, handle: A2AHandle, out=None):
        lay = self.layout
        S = sum(handle.send_splits)
        H = expert_out.shape[1]
        if self.back is None or self.back.dtype != expert_out.dtype or self.back.shape[1] != H:
            self.back = None
        self.back = grow_rows(self.back, S, lambda n: torch.empty(n, H, dtype=expert_out.dtype,
                                                                  device=expert_out.device))
        back = self.back[:S]
        all_to_all_single(back, expert_out.contiguous(), handle.send_splits, handle.recv_splits, group=lay.group,
                          world_size=lay.ep_size)
        self._mark("payload_a2a")
        if out is None:
            out = torch.empty(handle.num_tokens, H, dtype=expert_out.dtype, device=expert_out.device)
        # every row is written: rows no rank computed for get 0
        (combine_fixed if self.use_triton else combine_fixed_torch)(back, handle.send_pos, out, 0,
                                                                    offsets=handle.offsets)
        self._mark("reduce")
        return out

    def received(self, d: Dispatched) -> ReceivedRows:
        h: A2AHandle = d.handle
        dev = d.recv_x.device
        src_rank = torch.repeat_interleave(torch.arange(self.layout.ep_size, device=dev),
                                           torch.tensor(h.recv_splits, device=dev))
        return ReceivedRows(row_index=torch.arange(d.recv_x.shape[0], device=dev), src_rank=src_rank,
                            src_row=h.recv_src_row.to(torch.int64))

    def wire_row_bytes(self) -> int:
        return self.rows.row_bytes
