"""`agrs`: the naive path. All-gather every rank's rows and routing (and padding flags), compute this rank's
experts on all of them, reduce-scatter the partial outputs back. Every rank sees every row: padded rows travel
whether masked or not (all_gather needs equal row counts, which DP padding provides); the mask only removes their
routes, so they cost no expert work.

The hidden rows' all_gather is launched first, so the small metadata packing (ids with padded rows' slots set to
-1, weights' bits, padding flags) and its all_gather queue up behind the big transfer instead of delaying it; the
receiver makes the ids local in one kernel (moebench.dispatch.permute.localize_ids). Receive buffers are kept from
call to call (what dispatch returns are views of them, valid until the next dispatch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.dispatch.base import Dispatched, DispatchPath, ReceivedRows, dispatch_path, local_ids
from moebench.dispatch.comm import all_gather_rows, reduce_scatter_rows, triton_default
from moebench.dispatch.permute import localize_ids
from moebench.kernels.contract import check_mask


def meta_weights(meta: torch.Tensor, top_k: int) -> torch.Tensor:
    """The fp32 weights inside an int32 metadata buffer [rows, 2K+1] (ids, weights' bits, one int per row): a strided
    view, no copy."""
    return meta[:, top_k:2 * top_k].view(torch.float32)


@dataclass
class AGRSHandle:
    num_tokens: int
    recv_is_padding: torch.Tensor  # int32 [R*T]: the gathered padding flags (0 when no mask was given)


@dispatch_path("agrs", description="all-gather rows + routing, local experts on every row, reduce-scatter back")
class AGRSPath(DispatchPath):
    receives = "all"
    graph_capturable = True
    interpreter_programs_per_row = 0.25  # elementwise kernels over whole blocks: a few programs a call

    def __init__(self, layout, *, hidden: int, top_k: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", use_triton: bool | None = None):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        self.use_triton = triton_default(self.device) if use_triton is None else use_triton
        self._bufs: dict[str, torch.Tensor] = {}
        self._bufs_key: tuple | None = None

    def _buffers(self, T: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        key = (T, x.dtype, x.device)
        if key != self._bufs_key:
            R, K, H, dev = self.layout.ep_size, self.top_k, x.shape[1], x.device
            self._bufs = {"recv_x": torch.empty(R * T, H, dtype=x.dtype, device=dev),
                          "meta": torch.empty(T, 2 * K + 1, dtype=torch.int32, device=dev),
                          "recv_meta": torch.empty(R * T, 2 * K + 1, dtype=torch.int32, device=dev),
                          "recv_ids": torch.empty(R * T, K, dtype=torch.int32, device=dev)}
            self._bufs_key = key
        return self._bufs

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        R = lay.ep_size
        T, K = topk_ids.shape
        check_mask(is_padding, T)
        b = self._buffers(T, x)
        all_gather_rows(b["recv_x"], x.contiguous(), lay.group, R)  # the big transfer first
        self._mark("gather_x")
        meta = b["meta"]
        ids = topk_ids.to(torch.int32)
        if is_padding is not None:
            torch.where(is_padding.unsqueeze(1), torch.full_like(ids, -1), ids, out=meta[:, :K])
            meta[:, 2 * K].copy_(is_padding)
        else:
            meta[:, :K].copy_(ids)
            meta[:, 2 * K].zero_()
        meta[:, K:2 * K].copy_(topk_weights.to(torch.float32).contiguous().view(torch.int32))
        self._mark("pack_meta")
        all_gather_rows(b["recv_meta"], meta, lay.group, R)
        self._mark("gather_meta")
        recv_meta = b["recv_meta"]
        if self.use_triton:
            recv_ids = localize_ids(recv_meta[:, :K], lay.expert_offset, lay.local_experts, out=b["recv_ids"])
        else:
            recv_ids = b["recv_ids"]
            recv_ids.copy_(local_ids(recv_meta[:, :K], lay))
        self._mark("localize")
        counts = [T] * R
        return Dispatched(recv_x=b["recv_x"], recv_topk_ids=recv_ids, recv_topk_weights=meta_weights(recv_meta, K),
                          num_recv=R * T, handle=AGRSHandle(T, recv_meta[:, 2 * K]), send_counts=counts,
                          recv_counts=counts)

    def combine(self, expert_out, handle: AGRSHandle, out=None):
        lay = self.layout
        if out is None:
            out = torch.empty(handle.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                              device=expert_out.device)
        reduce_scatter_rows(out, expert_out.contiguous(), lay.group, lay.ep_size)
        self._mark("reduce_scatter")
        return out

    def received(self, d: Dispatched) -> ReceivedRows:
        T = d.handle.num_tokens
        n = d.recv_x.shape[0]
        dev = d.recv_x.device
        idx = torch.arange(n, device=dev)
        return ReceivedRows(row_index=idx, src_rank=idx // T, src_row=idx % T)

    def combine_recv_rows(self, d: Dispatched) -> int:
        # reduce-scatter: this rank's T output rows get a partial sum from each of the R ranks
        return d.handle.num_tokens * self.layout.ep_size

    def wire_row_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + (2 * self.top_k + 1) * 4
