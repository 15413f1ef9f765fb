"""`deepep`: DeepEP's legacy `Buffer` behind the moebench dispatch interface, when `deep_ep` imports (the V2
`ElasticBuffer` paths are moebench.dispatch.deepep_v2; the detection here serves both).

- `DeepEPNormalPath` (the path `deepep`): intranode normal mode (get_dispatch_layout -> dispatch -> combine).
  Exact sizes (a CPU sync inside dispatch), one row per (token, rank) pair, local ids, combine sums without weights.
- `DeepEPLowLatencyPath`: low-latency mode (low_latency_dispatch / low_latency_combine), what the path `deepep`
  builds when low_latency (DeepEPKnobs): per local expert blocks of `num_max_dispatch_tokens_per_rank * R` rows, one
  row per (token, expert) slot; the weights stay on the source and low_latency_combine applies them.

The calls follow DeepEP's public repository (deep_ep/buffers/legacy.py and its tests). Without `deep_ep` every
DeepEP impl reports "deep_ep not installed" and its points are recorded as skipped.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch

from moebench.dispatch.base import Dispatched, DispatchPath, EPLayout, ReceivedRows, dispatch_path, effective_ids
from moebench.params import register_knobs

try:  # detected once, at import
    import deep_ep  # type: ignore[import-not-found]

    DEEP_EP_ERROR: str | None = None
except ModuleNotFoundError as _e:
    deep_ep = None
    DEEP_EP_ERROR = "deep_ep not installed" if _e.name == "deep_ep" else f"deep_ep import failed: {_e}"
except Exception as _e:  # noqa: BLE001 - a broken build (NCCL mismatch, JIT init) must not break moebench
    deep_ep = None
    DEEP_EP_ERROR = f"deep_ep import failed: {type(_e).__name__}: {str(_e).strip().splitlines()[-1:]}"

DEFAULT_NUM_SMS = 24  # legacy normal kernels (DeepEP's README example)


def unavailable(kind: str = "legacy") -> str | None:
    """None when the DeepEP API `kind` ("legacy" Buffer or "v2" ElasticBuffer) can be used, else why not."""
    if deep_ep is None:
        return DEEP_EP_ERROR
    if kind == "v2" and not hasattr(deep_ep, "ElasticBuffer"):
        return f"deep_ep {getattr(deep_ep, '__version__', '?')} has no ElasticBuffer (V2)"
    if kind == "legacy" and not hasattr(deep_ep, "Buffer"):
        return f"deep_ep {getattr(deep_ep, '__version__', '?')} has no legacy Buffer"
    return None


def available_here(kind: str, ctx) -> str | None:
    """A DeepEP path's `available`: the API `kind` is there and this is a GPU."""
    return unavailable(kind) or (None if ctx.is_cuda else "deep_ep needs CUDA GPUs")


def require(kind: str) -> None:
    """Raise why the DeepEP API `kind` cannot be used, if it cannot."""
    why = unavailable(kind)
    if why:
        raise RuntimeError(why)


def topk_idx_dtype() -> torch.dtype:
    """The routing dtype DeepEP's kernels take."""
    return getattr(deep_ep, "topk_idx_t", torch.int64)


def accepts(fn: Any, name: str) -> bool:
    """Does `fn` take a parameter `name` (DeepEP versions differ)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def process_group(layout: EPLayout):
    """The layout's group, the default group when it has none."""
    import torch.distributed as dist

    return layout.group if layout.group is not None else dist.group.WORLD


def combined_into(combined_x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A DeepEP combine's output under combine's `out=` contract: as returned, or copied into `out`."""
    if out is None:
        return combined_x
    out.copy_(combined_x)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Legacy Buffer, normal (intranode) mode
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class NormalHandle:
    deepep_handle: tuple
    num_tokens: int
    ids: torch.Tensor  # the effective int32 routing that was dispatched (for accounting)


@register_knobs
@dataclass(frozen=True)
class DeepEPKnobs:
    """The sweep key of the DeepEP paths: low_latency (the legacy Buffer's low-latency mode instead of normal mode)."""

    low_latency: bool = False

    KEYED_AT_DEFAULT = frozenset({"low_latency"})


@dispatch_path("deepep", description="DeepEP legacy Buffer: intranode normal mode, or low-latency mode with "
                                      "low_latency: true")
class DeepEPNormalPath(DispatchPath):
    receives = "token"
    graph_capturable = False  # dispatch waits on the CPU for the received counts

    @classmethod
    def available(cls, ctx) -> str | None:
        return available_here("legacy", ctx)

    @classmethod
    def from_point(cls, layout, p, topk_ids, is_padding, device) -> DispatchPath:
        """Normal mode, or low-latency mode (blocks sized for this step's rows) when low_latency (DeepEPKnobs)."""
        common = dict(hidden=p.hidden, top_k=p.top_k, dtype=torch.bfloat16, device=device)
        if p.knobs(DeepEPKnobs).low_latency:
            return DeepEPLowLatencyPath(layout, num_max_dispatch_tokens_per_rank=topk_ids.shape[0], **common)
        return cls(layout, **common)

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, dtype=torch.bfloat16, device="cuda",
                 num_sms: int = DEFAULT_NUM_SMS):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        require("legacy")
        Buffer = deep_ep.Buffer
        Buffer.set_num_sms(num_sms)
        R = layout.ep_size
        hidden_bytes = hidden * max(torch.empty(0, dtype=dtype).element_size(), 2)
        num_nvl_bytes = 0
        for config in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, R), num_nvl_bytes)
        kwargs = {"explicitly_destroy": True} if accepts(Buffer.__init__, "explicitly_destroy") else {}
        self.buffer = Buffer(process_group(layout), num_nvl_bytes, 0, **kwargs)
        self._explicit = bool(kwargs)

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        ids = effective_ids(topk_ids, is_padding)
        topk_idx = ids.to(topk_idx_dtype())
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
            self.buffer.get_dispatch_layout(topk_idx, lay.num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights.to(torch.float32),
            num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
        # handle[0] is the rank prefix matrix: [i][r] = rows rank r receives from ranks <= i
        prefix = handle[0][:, lay.rank]
        recv_counts = torch.diff(prefix, prepend=prefix.new_zeros(1))
        return Dispatched(recv_x=recv_x, recv_topk_ids=recv_topk_idx, recv_topk_weights=recv_topk_weights,
                          num_recv=recv_x.shape[0], handle=NormalHandle(handle, x.shape[0], ids),
                          send_counts=num_tokens_per_rank, recv_counts=recv_counts)

    def dispatch_cached(self, x, handle: NormalHandle) -> torch.Tensor:
        """Dispatch `x` again along a previous dispatch's layout (DeepEP's cached mode: no layout kernel, no
        count notification, no CPU sync). This is what DeepEP's own intranode test times; a serving step with new
        routing cannot use it, so moebench reports it beside the full dispatch, never instead of it."""
        recv_x, _, _, _, _, _ = self.buffer.dispatch(x, handle=handle.deepep_handle)
        return recv_x

    def combine(self, expert_out, handle: NormalHandle, out=None):
        combined_x, _, _ = self.buffer.combine(expert_out, handle.deepep_handle)
        return combined_into(combined_x, out)

    def received(self, d: Dispatched) -> ReceivedRows:
        h = d.handle.deepep_handle
        src_idx = h[3].to(torch.int64)  # recv_src_idx: row index on the source rank
        counts = d.recv_counts.to(torch.int64)
        src_rank = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        return ReceivedRows(row_index=torch.arange(src_idx.numel(), device=src_idx.device), src_rank=src_rank,
                            src_row=src_idx)

    def row_payload_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + self.top_k * 8  # same logical payload as the torch paths

    def close(self) -> None:
        if self._explicit and self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None


# ---------------------------------------------------------------------------------------------------------------
# Legacy Buffer, low-latency mode
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class LowLatencyHandle:
    deepep_handle: tuple
    topk_idx: torch.Tensor  # the dispatched routing (low_latency_combine needs it with the weights)
    topk_weights: torch.Tensor
    recv_count: torch.Tensor  # int [E_local]
    num_tokens: int


class DeepEPLowLatencyPath(DispatchPath):
    name = "deepep_ll"
    receives = "slot"
    graph_capturable = True
    sends_weights = False

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, num_max_dispatch_tokens_per_rank: int,
                 dtype=torch.bfloat16, device="cuda"):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        require("legacy")
        Buffer = deep_ep.Buffer
        R, E = layout.ep_size, layout.num_experts
        self.max_tokens = int(num_max_dispatch_tokens_per_rank)
        # low_latency_dispatch asserts NVSHMEM's QP depth >= 2 * (max tokens + 1); the default is 1024
        os.environ.setdefault("NVSHMEM_QP_DEPTH", str(max(1024, 2 * (self.max_tokens + 1))))
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(self.max_tokens, hidden, R, E)
        kwargs = {"explicitly_destroy": True} if accepts(Buffer.__init__, "explicitly_destroy") else {}
        self.buffer = Buffer(process_group(layout), 0, num_rdma_bytes, low_latency_mode=True,
                             num_qps_per_rank=layout.local_experts, **kwargs)
        self._explicit = bool(kwargs)
        rows = layout.local_experts * R * self.max_tokens
        self._slot_in_block = torch.arange(R * self.max_tokens, device=self.device)
        self._expert_of_row = torch.arange(layout.local_experts, device=self.device, dtype=torch.int32) \
            .repeat_interleave(R * self.max_tokens)
        self._ones = torch.ones(rows, 1, dtype=torch.float32, device=self.device)

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} rows exceed num_max_dispatch_tokens_per_rank={self.max_tokens}")
        ids = effective_ids(topk_ids, is_padding)
        topk_idx = ids.to(topk_idx_dtype())
        packed_recv_x, packed_recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, topk_idx, self.max_tokens, lay.num_experts, use_fp8=False, async_finish=False,
            return_recv_hook=False)
        valid = self._slot_in_block.unsqueeze(0) < packed_recv_count.to(torch.int64).unsqueeze(1)  # [E_loc, R*max]
        recv_ids = torch.where(valid.reshape(-1), self._expert_of_row, -1).unsqueeze(1)
        h = LowLatencyHandle(handle, topk_idx, topk_weights.to(torch.float32), packed_recv_count, x.shape[0])
        return Dispatched(recv_x=packed_recv_x.view(-1, self.hidden), recv_topk_ids=recv_ids,
                          recv_topk_weights=self._ones, num_recv=packed_recv_count, handle=h,
                          send_counts=None, recv_counts=None)

    def dispatch_fp8_counts(self, x, topk_ids, is_padding=None) -> torch.Tensor:
        """DeepEP's FP8 low-latency dispatch (e4m3 rows with per-128-channel scales: about half the bytes), the
        mode DeepEP's own low-latency test times. Its rows are not the bf16 rows, so moebench times it and checks
        only that it delivers the same per-expert counts as the bf16 dispatch; returns them (int [E_local])."""
        ids = effective_ids(topk_ids, is_padding).to(topk_idx_dtype())
        _, recv_count, _, _, _ = self.buffer.low_latency_dispatch(
            x, ids, self.max_tokens, self.layout.num_experts, use_fp8=True, async_finish=False,
            return_recv_hook=False)
        return recv_count

    def combine(self, expert_out, handle: LowLatencyHandle, out=None):
        lay = self.layout
        y = expert_out.view(lay.local_experts, lay.ep_size * self.max_tokens, self.hidden)
        combined_x, _, _ = self.buffer.low_latency_combine(y, handle.topk_idx, handle.topk_weights,
                                                           handle.deepep_handle, async_finish=False,
                                                           return_recv_hook=False)
        return combined_into(combined_x, out)

    def received(self, d: Dispatched) -> ReceivedRows:
        lay = self.layout
        src_info, layout_range = d.handle.deepep_handle[0], d.handle.deepep_handle[1]
        block = lay.ep_size * self.max_tokens
        rows, ranks, srcs, experts = [], [], [], []
        lr = layout_range.to(torch.int64).cpu()
        info = src_info.to(torch.int64).cpu()
        for e in range(lay.local_experts):
            for j in range(lay.ep_size):  # rank j's rows for expert e: [begin, begin + count)
                begin, count = int(lr[e, j] >> 32), int(lr[e, j] & 0xFFFFFFFF)
                r = torch.arange(begin, begin + count)
                rows.append(e * block + r)
                ranks.append(torch.full((count,), j))
                srcs.append(info[e, begin:begin + count])
                experts.append(torch.full((count,), e))
        cat = (lambda xs: torch.cat(xs).to(torch.int64)) if rows else (lambda xs: torch.zeros(0, dtype=torch.int64))
        return ReceivedRows(row_index=cat(rows), src_rank=cat(ranks), src_row=cat(srcs), local_expert=cat(experts))

    def stats(self, d: Dispatched):
        got = self.received(d)
        R = self.layout.ep_size
        d.recv_counts = torch.bincount(got.src_rank, minlength=R)
        # one row per (token, expert) slot: slots this rank sends to each destination
        ids = d.handle.topk_idx.to(torch.int64)
        dest = torch.where(ids >= 0, ids // self.layout.local_experts, R)
        d.send_counts = torch.bincount(dest.flatten().cpu(), minlength=R + 1)[:R]
        return super().stats(d)

    def row_payload_bytes(self) -> int:
        return self.hidden * torch.empty(0, dtype=self.dtype).element_size()

    def wire_recv_rows(self, d: Dispatched) -> int:
        return self.layout.local_experts * self.layout.ep_size * self.max_tokens

    def close(self) -> None:
        if self._explicit and self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None
