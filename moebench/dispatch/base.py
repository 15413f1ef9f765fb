"""The one interface of the expert-parallel dispatch paths, the hooks the benchmark drives them through, and the
path registry.

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

A new path is one module of this package: a DispatchPath subclass under `@dispatch_path("name", description=...)`.
`package_paths()` imports every module of the package (discovery, no hand-kept list) and moebench.bench.dispatch
registers one timed impl `dispatch.<name>` per path, driven only through the hooks below (from_point, the
capability flags, available / validate, prepare_check, extra_checks, record_info).
"""

from __future__ import annotations

import importlib
import pkgutil
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from moebench.check import CheckResult
from moebench.dispatch.pack import CapacityKnobs
from moebench.kernels.contract import check_mask
from moebench.params import EPLayout, Params  # EPLayout: part of this interface (paths are built on one)

if TYPE_CHECKING:  # pragma: no cover
    from moebench.registry import RunContext

PACKAGE = "moebench.dispatch"  # every module of it is imported by package_paths()


# ---------------------------------------------------------------------------------------------------------------
# The stage timer
# ---------------------------------------------------------------------------------------------------------------

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
# Expert ownership (the layout itself, EPLayout, is moebench.params's)
# ---------------------------------------------------------------------------------------------------------------

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
    R = layout.ep_size
    valid = (ids >= 0) & (ids < layout.num_experts)
    dest = torch.where(valid, ids.div(layout.local_experts, rounding_mode="floor"), R).to(torch.int64)
    onehot = torch.zeros(T, R + 1, dtype=torch.bool, device=ids.device)
    onehot.scatter_(1, dest, True)  # column R collects the slots that go nowhere
    return onehot[:, :R]


def local_ids(global_ids: torch.Tensor, layout: EPLayout) -> torch.Tensor:
    """int32: global id -> this rank's local id, -1 where the expert is not on this rank (or the id is -1)."""
    off = layout.expert_offset
    g = global_ids.to(torch.int32)
    mine = (g >= off) & (g < off + layout.local_experts)
    return torch.where(mine, g - off, torch.full_like(g, -1))


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


# ---------------------------------------------------------------------------------------------------------------
# The interface and its hooks
# ---------------------------------------------------------------------------------------------------------------

class DispatchPath:
    """Base class. Subclasses set `receives` (and the capability flags that differ), implement dispatch / combine /
    received, and override the hooks they need; `@dispatch_path` gives them their `name` and `description`."""

    name = "base"
    description = ""
    # What one received row is: "token" (a (token, rank) pair with all its local slots), "all" (every row of
    # every rank, agrs), or "slot" (a (token, local expert) pair, one slot per row: DeepEP low-latency/expand).
    receives = "token"
    graph_capturable = False
    sends_weights = True  # False: weights stay on the source and combine applies them (DeepEP low-latency)
    # True: the path's buffers are sized by num_max_tokens_per_rank (CapacityKnobs), so a step may not have more rows
    buffers_sized_by_max_tokens = False
    # Triton's CPU interpreter: program-equivalents of one dispatch + combine per row of the batch (the run's
    # estimate, moebench.measure.cost); the plan / pack / combine kernels' grids grow with the rows
    interpreter_programs_per_row = 20.0

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
        return sum(_as_list(d.recv_counts, self.layout.ep_size))

    def wire_row_bytes(self) -> int:
        return self.row_payload_bytes()

    def stats(self, d: Dispatched) -> DispatchStats:
        R, rank = self.layout.ep_size, self.layout.rank
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
        return sum(_as_list(d.send_counts, self.layout.ep_size))


    # -- hooks the benchmark calls ---------------------------------------------------------------------------------
    @classmethod
    def available(cls, ctx: "RunContext") -> str | None:
        """None when the path can run here, else why not (a missing library, no GPU)."""
        return None

    @classmethod
    def validate(cls, p: "Params") -> str | None:
        """None when point p is possible for the path, else why not (checked before anything runs)."""
        if p.ep_mode == "simulated" and p.ep_size > 1:
            return "ep_mode: dispatch paths run on ep_size real processes (simulated is not supported)"
        buffer_rows = p.knobs(CapacityKnobs).num_max_tokens_per_rank
        if cls.buffers_sized_by_max_tokens and p.num_tokens > buffer_rows:
            return f"num_tokens: {p.num_tokens} > num_max_tokens_per_rank {buffer_rows}"
        return None

    @classmethod
    def from_point(cls, layout: EPLayout, p: "Params", topk_ids: torch.Tensor, is_padding: torch.Tensor | None,
                   device: torch.device) -> "DispatchPath":
        """The path for point p, given the routing this rank will dispatch (`is_padding`: the mask, None when
        oblivious). Called on every rank of the group, so it may be collective (a2a_fixed sizes its capacity from
        every rank's routing)."""
        return cls(layout, hidden=p.hidden, top_k=p.top_k, dtype=torch.bfloat16, device=device)

    def prepare_check(self, generator: torch.Generator) -> None:
        """Before the checked dispatch: make state that must not matter look like it could (a2a_fixed: stale
        buffers full of valid-looking garbage, the overflow flag reset)."""

    def extra_checks(self, d: Dispatched) -> list[CheckResult]:
        """The path's own checks of the checked dispatch `d`, beyond the received rows and the combined output
        every path gets (host syncs allowed)."""
        return []

    def record_info(self, p: "Params") -> dict[str, Any]:
        """Extra fields for the record's info (a2a_fixed: its capacity and policy)."""
        return {}


# ---------------------------------------------------------------------------------------------------------------
# The path registry
# ---------------------------------------------------------------------------------------------------------------

_PATHS: dict[str, type[DispatchPath]] = {}
PathType = TypeVar("PathType", bound=type[DispatchPath])


def dispatch_path(name: str, *, description: str) -> Callable[[PathType], PathType]:
    """Class decorator: register a DispatchPath subclass as the path `name` (timed as the impl `dispatch.<name>`)."""
    def deco(cls: PathType) -> PathType:
        if not (isinstance(cls, type) and issubclass(cls, DispatchPath)):
            raise TypeError(f"dispatch path {name!r}: {cls!r} is not a DispatchPath subclass")
        if name in _PATHS and _PATHS[name] is not cls:
            raise ValueError(f"dispatch path {name!r} registered twice")
        cls.name = name
        cls.description = description
        _PATHS[name] = cls
        return cls
    return deco


def package_paths() -> dict[str, type[DispatchPath]]:
    """The paths of this package, in registration order: every non-underscore module is imported (a path module
    registers its classes as it is imported; the helper modules register none). Paths registered from elsewhere
    (a test, a plugin) are not in it: they are registered as impls explicitly."""
    pkg = importlib.import_module(PACKAGE)
    for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{PACKAGE}.{m.name}")
    return {n: c for n, c in _PATHS.items() if c.__module__.startswith(PACKAGE + ".")}


def path_class(name: str) -> type[DispatchPath]:
    """The registered path `name` (the package's paths are discovered first)."""
    package_paths()
    if name not in _PATHS:
        raise ValueError(f"unknown dispatch path {name!r} (one of {', '.join(_PATHS)})")
    return _PATHS[name]
