"""The one interface of the expert-parallel dispatch paths, and what they share.

Experts are split evenly: rank r owns the global experts [r*E/R, (r+1)*E/R). A path moves each (token, destination
rank) pair at most once, never sends a route whose id is -1, and with `is_padding` given (mask-aware) never sends a
padded row at all. Without it (oblivious) padded rows travel like real ones, with whatever ids the router gave.

    d = path.dispatch(x [T,H], topk_ids [T,K] global (-1 = none), topk_weights [T,K], is_padding=None)
    d.recv_x [N,H], d.recv_topk_ids [N,K'] LOCAL ids (-1: slot not for this rank, none, or row not valid),
    d.recv_topk_weights [N,K'], d.num_recv, d.handle
    out = path.combine(expert_out [N,H], d.handle)   # expert_out: weighted sum over this rank's slots per row
    out [T,H] is the sum over ranks, in the original row order.

`stats(d)` and `received(d)` read device counters back (a host sync): call them outside timed regions.
The torch paths (agrs, a2a, a2a_fixed) keep their buffers from call to call (nothing is allocated in a steady-state
step): what `dispatch` returns, the handle included, are views of them, valid until the path's next dispatch.

`path.timer = StageTimer(device)` records CUDA events and host time at the paths' named sub-steps (count exchange,
permutation, payload all-to-all, unpack...), for the per-stage breakdown in scripts/gpu_dispatch.py.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from moebench.kernels._details.args import check_mask
from moebench.registry import CheckResult

CAPACITY_POLICIES = ("exact", "pow2", "max")


# ---------------------------------------------------------------------------------------------------------------
# Collectives that degenerate to copies on one rank (ep_size 1 needs no process group)
# ---------------------------------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    return dist


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                      in_splits: list[int] | None = None, group: Any = None, world_size: int = 1) -> None:
    if world_size == 1:
        out.copy_(inp)
        return
    _dist().all_to_all_single(out, inp, out_splits, in_splits, group=group)


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: Any = None, world_size: int = 1) -> None:
    """out [R*T, ...] = cat over ranks of inp [T, ...] (rank order)."""
    if world_size == 1:
        out.copy_(inp)
        return
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name where it exists
    fn(out, inp, group=group)


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group: Any = None, world_size: int = 1) -> None:
    """out [T, ...] = sum over ranks of their inp [R*T, ...] rows [rank*T, (rank+1)*T)."""
    if world_size == 1:
        out.copy_(inp)
        return
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


# ---------------------------------------------------------------------------------------------------------------
# Steady-state helpers: buffers that only grow, a side stream, the stage timer
# ---------------------------------------------------------------------------------------------------------------

GROW_ROWS = 256  # a growing buffer is rounded up to this many rows, so slightly larger steps reuse it


def grow_rows(buf: torch.Tensor | None, rows: int, make) -> torch.Tensor:
    """`buf` when it has at least `rows` rows, else `make(n)` with n >= rows (allocation happens on the first
    step of a size only, i.e. in warm-up)."""
    if buf is not None and buf.shape[0] >= rows:
        return buf
    return make(max(GROW_ROWS, -(-rows // GROW_ROWS) * GROW_ROWS))


class SideStream:
    """A second CUDA stream for small work that should overlap the main stream's (the count exchange beside the
    permutation). `fork_here()` right after the work the side job needs, then more main-stream work, then
    `with side.run():` the side job, and `join()` before main-stream work that needs its result. In stream order
    instead on a CPU and while a CUDA graph is being captured."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self._forked = torch.cuda.Event() if cuda else None
        self._main = None

    def fork_here(self) -> None:
        if self.stream is None or torch.cuda.is_current_stream_capturing():
            self._main = None
            return
        self._main = torch.cuda.current_stream(self.stream.device)
        self._forked.record(self._main)

    @contextmanager
    def run(self) -> Iterator[None]:
        if self._main is None:
            yield
            return
        self.stream.wait_event(self._forked)  # only what the main stream had at fork_here()
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self.stream)
            self._main = None


class StageTimer:
    """Named points inside one call: a CUDA event on the stream current at that point (GPU time) and the host
    clock (when the launch call returned). `table()` gives, per point, the median over calls of both, relative to
    the call's start: a GPU time far behind the host time means the GPU waited for launches (host-bound)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.calls: list[list[tuple[str, Any, float]]] = []
        self._cur: list[tuple[str, Any, float]] | None = None

    def begin(self) -> None:
        self._cur = []
        self.mark("start")

    def mark(self, label: str) -> None:
        if self._cur is None:
            return
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self._cur.append((label, ev, time.perf_counter()))

    def end(self) -> None:
        self.mark("end")
        self.calls.append(self._cur)
        self._cur = None

    def table(self) -> list[dict[str, Any]]:
        """[{label, gpu_us, host_us}] in the order of the first call (gpu_us None without CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        per: dict[str, dict[str, list[float]]] = {}
        for call in self.calls:
            _, ev0, h0 = call[0]
            for label, ev, h in call:
                d = per.setdefault(label, {"gpu": [], "host": []})
                d["host"].append((h - h0) * 1e6)
                if ev is not None:
                    d["gpu"].append(ev0.elapsed_time(ev) * 1e3)
        return [{"label": k, "gpu_us": statistics.median(v["gpu"]) if v["gpu"] else None,
                 "host_us": statistics.median(v["host"])} for k, v in per.items()]


# ---------------------------------------------------------------------------------------------------------------
# Expert ownership
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EPLayout:
    """Where this rank sits: rank r of R owns experts [r*E/R, (r+1)*E/R)."""

    rank: int
    world_size: int
    num_experts: int
    group: Any = None

    def __post_init__(self):
        if self.num_experts % self.world_size:
            raise ValueError(f"ep_size {self.world_size} does not divide num_experts {self.num_experts}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_offset(self) -> int:
        return self.rank * self.experts_per_rank


def effective_ids(topk_ids: torch.Tensor, is_padding: torch.Tensor | None) -> torch.Tensor:
    """int32 routing with padded rows' slots set to -1 (mask-aware); the ids as given otherwise."""
    check_mask(is_padding, topk_ids.shape[0])
    ids = topk_ids.to(torch.int32)
    if is_padding is not None:
        ids = ids.masked_fill(is_padding.unsqueeze(1), -1)
    return ids


def token_in_rank(ids: torch.Tensor, layout: EPLayout) -> torch.Tensor:
    """bool [T, R]: does row t have at least one route to rank r. Ids -1 (or out of range) route nowhere."""
    T = ids.shape[0]
    R = layout.world_size
    valid = (ids >= 0) & (ids < layout.num_experts)
    dest = torch.where(valid, ids.div(layout.experts_per_rank, rounding_mode="floor"), R).to(torch.int64)
    onehot = torch.zeros(T, R + 1, dtype=torch.bool, device=ids.device)
    onehot.scatter_(1, dest, True)  # column R collects the slots that go nowhere
    return onehot[:, :R]


def local_ids(global_ids: torch.Tensor, layout: EPLayout) -> torch.Tensor:
    """int32: global id -> this rank's local id, -1 where the expert is not on this rank (or the id is -1)."""
    off = layout.expert_offset
    g = global_ids.to(torch.int32)
    mine = (g >= off) & (g < off + layout.experts_per_rank)
    return torch.where(mine, g - off, torch.full_like(g, -1))


def meta_weights(meta: torch.Tensor, top_k: int) -> torch.Tensor:
    """The fp32 weights inside an int32 metadata buffer [rows, 2K+1] (ids, weights' bits, one int per row): a strided
    view, no copy."""
    return meta[:, top_k:2 * top_k].view(torch.float32)


def capacity_for(policy: str, max_rows: int, buffer_rows: int) -> int:
    """Rows per (source, destination) block of the fixed-capacity path.

    exact: the step's max rows per (src, dst) pair; pow2: its next power of two, capped at the buffer;
    max: always the buffer size. Never below 1 (an empty step still launches valid kernels).
    """
    if policy not in CAPACITY_POLICIES:
        raise ValueError(f"unknown capacity policy {policy!r} (one of {', '.join(CAPACITY_POLICIES)})")
    if buffer_rows < 1:
        raise ValueError(f"buffer_rows must be >= 1, got {buffer_rows}")
    need = max(1, int(max_rows))
    if need > buffer_rows:
        raise ValueError(f"max rows per rank pair {need} exceed the buffer ({buffer_rows} rows): raise "
                         f"num_max_tokens_per_rank")
    if policy == "exact":
        return need
    if policy == "pow2":
        return min(1 << (need - 1).bit_length(), buffer_rows)
    return buffer_rows


def max_rows_per_pair(topk_ids: torch.Tensor, is_padding: torch.Tensor | None, layout: EPLayout) -> int:
    """The step's max rows any rank sends to any rank (all_reduce MAX; a host sync, for set-up only)."""
    in_rank = token_in_rank(effective_ids(topk_ids, is_padding), layout)
    mx = in_rank.sum(0).max().reshape(1).to(torch.int64) if in_rank.numel() else \
        torch.zeros(1, dtype=torch.int64, device=topk_ids.device)
    if layout.world_size > 1:
        dist = _dist()
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(layout.group) == "nccl" \
            else torch.device("cpu")
        mx = mx.to(dev)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=layout.group)
    return int(mx.item())


# ---------------------------------------------------------------------------------------------------------------
# What a dispatch returns and what it cost
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Dispatched:
    recv_x: torch.Tensor  # [N, H]
    recv_topk_ids: torch.Tensor  # [N, K'] int32 LOCAL ids, -1 = not for this rank / none / row not valid
    recv_topk_weights: torch.Tensor  # [N, K'] fp32; meaningful where recv_topk_ids >= 0
    num_recv: int | torch.Tensor  # valid rows (python int, or a device tensor where reading it would sync)
    handle: Any  # what combine needs
    send_counts: torch.Tensor | list[int] | None = None  # rows sent to each destination rank
    recv_counts: torch.Tensor | list[int] | None = None  # valid rows received from each source rank


@dataclass
class DispatchStats:
    """Traffic of one dispatch (and its combine), from this rank's point of view.

    Payload = hidden row + ids + weights of each valid row (what the step must move); wire = what the path
    actually moves into this rank's buffers (fixed capacity: whole blocks, garbage rows included; metadata layout).
    All figures include the rows a rank sends to itself (`own_included`); the own share is given separately.
    """

    rows_sent_per_dest: list[int]
    rows_recv_per_src: list[int]
    row_payload_bytes: int
    recv_rows: int
    recv_rows_own: int
    recv_payload_bytes: int
    recv_payload_bytes_own: int
    wire_recv_bytes: int
    combine_recv_bytes: int  # expert outputs coming back (payload rows, own included)
    own_included: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def as_info(self) -> dict[str, Any]:
        return {"rows_sent_per_dest": self.rows_sent_per_dest, "rows_recv_per_src": self.rows_recv_per_src,
                "recv_rows": self.recv_rows, "recv_rows_own": self.recv_rows_own,
                "dispatch_payload_bytes": self.recv_payload_bytes,
                "dispatch_payload_bytes_own": self.recv_payload_bytes_own,
                "dispatch_wire_bytes": self.wire_recv_bytes, "combine_payload_bytes": self.combine_recv_bytes,
                "bytes_include_own_rank": self.own_included, **self.extra}


@dataclass
class ReceivedRows:
    """The valid received rows, by origin (for checks): row `row_index[i]` of recv_x came from row `src_row[i]`
    of rank `src_rank[i]` (and, for per-expert layouts, for local expert `local_expert[i]`)."""

    row_index: torch.Tensor  # int64 [M]
    src_rank: torch.Tensor  # int64 [M]
    src_row: torch.Tensor  # int64 [M]
    local_expert: torch.Tensor | None = None  # int64 [M], "slot" layouts only


def _as_list(v: torch.Tensor | list[int] | None, n: int) -> list[int]:
    if v is None:
        return [0] * n
    if isinstance(v, torch.Tensor):
        return [int(a) for a in v.detach().cpu().tolist()]
    return [int(a) for a in v]


class DispatchPath:
    """Base class. Subclasses set `name`, `receives` and implement dispatch / combine / received."""

    name = "base"
    # What one received row is: "token" (a (token, rank) pair with all its local slots), "all" (every row of
    # every rank, agrs), or "slot" (a (token, local expert) pair, one slot per row: DeepEP low-latency/expand).
    receives = "token"
    graph_capturable = False
    sends_weights = True  # False: weights stay on the source and combine applies them (DeepEP low-latency)

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        self.layout = layout
        self.hidden = hidden
        self.top_k = top_k
        self.dtype = dtype
        self.device = torch.device(device)
        self.timer: StageTimer | None = None

    def _mark(self, label: str) -> None:
        if self.timer is not None:
            self.timer.mark(label)

    # -- interface ---------------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 is_padding: torch.Tensor | None = None) -> Dispatched:
        raise NotImplementedError

    def combine(self, expert_out: torch.Tensor, handle: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def received(self, d: Dispatched) -> ReceivedRows:
        raise NotImplementedError

    def close(self) -> None:
        """Release communication buffers (DeepEP); nothing for the torch paths."""

    # -- accounting ----------------------------------------------------------------------------------------------
    def row_payload_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        meta = self.top_k * 8 if self.sends_weights else 0  # int32 id + fp32 weight per slot
        return self.hidden * elt + meta

    def wire_recv_rows(self, d: Dispatched) -> int:
        """Rows physically landing in this rank's receive buffer (default: the valid ones)."""
        return sum(_as_list(d.recv_counts, self.layout.world_size))

    def wire_row_bytes(self) -> int:
        return self.row_payload_bytes()

    def stats(self, d: Dispatched) -> DispatchStats:
        R, rank = self.layout.world_size, self.layout.rank
        sent = _as_list(d.send_counts, R)
        recv = _as_list(d.recv_counts, R)
        row = self.row_payload_bytes()
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return DispatchStats(
            rows_sent_per_dest=sent, rows_recv_per_src=recv, row_payload_bytes=row,
            recv_rows=sum(recv), recv_rows_own=recv[rank], recv_payload_bytes=sum(recv) * row,
            recv_payload_bytes_own=recv[rank] * row, wire_recv_bytes=self.wire_recv_rows(d) * self.wire_row_bytes(),
            combine_recv_bytes=self.combine_recv_rows(d) * self.hidden * elt)

    def combine_recv_rows(self, d: Dispatched) -> int:
        """Expert-output rows this rank receives back in combine (default: the rows it sent)."""
        return sum(_as_list(d.send_counts, self.layout.world_size))


# ---------------------------------------------------------------------------------------------------------------
# The benchmark's expert and the single-process references
# ---------------------------------------------------------------------------------------------------------------

def scaled_expert(recv_x: torch.Tensor, recv_ids: torch.Tensor, recv_w: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A cheap, exactly reproducible stand-in for the experts: expert e scales a row by (e + 1).

    y[i] = x[i] * sum_k w[i,k] * (ids[i,k] + 1) over slots with ids >= 0, accumulated in fp32 (k = 0..K-1),
    rounded once. Rows without a valid slot give 0 and are never read (garbage / NaN there cannot leak).
    """
    valid = recv_ids >= 0
    coef = torch.where(valid, recv_w.to(torch.float32) * (recv_ids.to(torch.float32) + 1.0),
                       torch.zeros((), dtype=torch.float32, device=recv_x.device)).sum(dim=1)
    y = torch.where(valid.any(dim=1, keepdim=True), recv_x.to(torch.float32) * coef.unsqueeze(1),
                    torch.zeros((), dtype=torch.float32, device=recv_x.device))
    if out is None:
        return y.to(recv_x.dtype)
    out.copy_(y)
    return out


def scaled_expert_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            experts_per_rank: int) -> torch.Tensor:
    """What one process holding every expert computes for rows x (global ids, -1 skipped): each expert scales by
    (its local index on its owner + 1), summed over all slots in fp32, rounded once."""
    ids = topk_ids.to(torch.int64)
    local = torch.where(ids >= 0, ids % experts_per_rank, torch.full_like(ids, -1))
    return scaled_expert(x, local, topk_weights)


@dataclass
class GatheredInputs:
    """Every rank's inputs, for the single-process reference (equal T per rank)."""

    x: torch.Tensor  # [R, T, H]
    topk_ids: torch.Tensor  # [R, T, K] global, as given to dispatch
    topk_weights: torch.Tensor  # [R, T, K]
    is_padding: torch.Tensor  # [R, T] bool: which rows are padding (whether or not the path was told)
    mask_aware: bool  # was is_padding given to dispatch


def gather_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  is_padding: torch.Tensor, mask_aware: bool, layout: EPLayout) -> GatheredInputs:
    R = layout.world_size
    T, K = topk_ids.shape

    def gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = torch.empty((R * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_rows(out, t, layout.group, R)
        return out.view((R,) + tuple(t.shape))

    return GatheredInputs(x=gather(x), topk_ids=gather(topk_ids.to(torch.int32)),
                          topk_weights=gather(topk_weights.to(torch.float32)),
                          is_padding=gather(is_padding.to(torch.uint8)).bool(), mask_aware=mask_aware)


def expected_received(g: GatheredInputs, layout: EPLayout, receives: str) -> ReceivedRows:
    """Which rows this rank must receive (sorted by source rank, source row[, local expert])."""
    R, T, K = g.topk_ids.shape
    ids = g.topk_ids.clone()
    if g.mask_aware:
        ids[g.is_padding] = -1
    local = local_ids(ids, layout)  # [R, T, K]
    src_rank = torch.arange(R, device=ids.device).view(R, 1).expand(R, T)
    src_row = torch.arange(T, device=ids.device).view(1, T).expand(R, T)
    if receives == "all":
        keep = torch.ones(R, T, dtype=torch.bool, device=ids.device)
    elif receives == "token":
        keep = (local >= 0).any(dim=2)
    elif receives == "slot":
        sel = (local >= 0).nonzero()  # (src_rank, src_row, k), row-major: sorted by rank, row, slot
        e = local[sel[:, 0], sel[:, 1], sel[:, 2]].to(torch.int64)
        # sort within a token by local expert (paths order slots by expert, not by k)
        key = (sel[:, 0] * T + sel[:, 1]) * layout.experts_per_rank + e
        order = torch.sort(key, stable=True).indices
        sel, e = sel[order], e[order]
        return ReceivedRows(row_index=torch.arange(sel.shape[0]), src_rank=sel[:, 0].to(torch.int64),
                            src_row=sel[:, 1].to(torch.int64), local_expert=e)
    else:
        raise ValueError(f"unknown receive layout {receives!r}")
    return ReceivedRows(row_index=torch.arange(int(keep.sum())), src_rank=src_rank[keep].to(torch.int64),
                        src_row=src_row[keep].to(torch.int64))


def check_received(path: DispatchPath, d: Dispatched, g: GatheredInputs, name: str = "recv") -> CheckResult:
    """Received rows bitwise equal to the single-process reference: same rows (by origin), hidden row bits,
    local ids exactly, and weights bitwise on the slots that are for this rank."""
    from moebench.check import compare_exact

    layout = path.layout
    exp = expected_received(g, layout, path.receives)
    got = path.received(d)
    R, T, K = g.topk_ids.shape
    E_loc = layout.experts_per_rank
    # order what was received by origin
    key = got.src_rank.cpu() * T + got.src_row.cpu()
    if got.local_expert is not None:
        key = key * E_loc + got.local_expert.cpu()
    order = torch.argsort(key)
    rows = got.row_index.cpu()[order]
    res = [compare_exact(f"{name}.src_rank", got.src_rank.cpu()[order], exp.src_rank.cpu()),
           compare_exact(f"{name}.src_row", got.src_row.cpu()[order], exp.src_row.cpu())]
    if not all(r.ok for r in res):
        return CheckResult.merge(*res)
    if got.local_expert is not None:
        res.append(compare_exact(f"{name}.expert", got.local_expert.cpu()[order], exp.local_expert.cpu()))
    sr, sw = exp.src_rank.cpu(), exp.src_row.cpu()
    recv_x = d.recv_x.cpu()
    recv_ids = d.recv_topk_ids.cpu()
    recv_w = d.recv_topk_weights.cpu()
    res.append(compare_exact(f"{name}.x", recv_x[rows], g.x.cpu()[sr, sw]))
    ids_all = g.topk_ids.cpu().clone()
    if g.mask_aware:
        ids_all[g.is_padding.cpu()] = -1
    exp_local = local_ids(ids_all, layout)[sr, sw]  # [M, K]
    w_all = g.topk_weights.cpu()[sr, sw]
    if path.receives == "slot":
        # one slot per row: the expert it is for; the weight of that slot where weights travel
        e = exp.local_expert.cpu()
        res.append(compare_exact(f"{name}.ids", recv_ids[rows, 0].to(torch.int64), e))
        if path.sends_weights:
            k_of = (exp_local == e.unsqueeze(1).to(exp_local.dtype)).to(torch.int64).argmax(dim=1)
            res.append(compare_exact(f"{name}.weights", recv_w[rows, 0],
                                     w_all.gather(1, k_of.unsqueeze(1)).squeeze(1)))
    else:
        res.append(compare_exact(f"{name}.ids", recv_ids[rows].to(torch.int32), exp_local))
        valid = exp_local >= 0
        res.append(compare_exact(f"{name}.weights", torch.where(valid, recv_w[rows], 0.0),
                                 torch.where(valid, w_all, 0.0)))
    return CheckResult.merge(*res)


def count_padding_received(path: DispatchPath, d: Dispatched, g: GatheredInputs) -> dict[str, int]:
    """Padded rows among the valid received rows: `padded_rows_received` (physically moved here) and
    `padded_routes_received` (padded rows that arrive with a live route to this rank, i.e. cost expert work)."""
    got = path.received(d)
    pad = g.is_padding.cpu()[got.src_rank.cpu(), got.src_row.cpu()]
    live = (d.recv_topk_ids.cpu()[got.row_index.cpu()] >= 0).any(dim=1)
    return {"padded_rows_received": int(pad.sum()), "padded_routes_received": int((pad & live).sum())}
