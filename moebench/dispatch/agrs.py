"""`agrs`: the naive path. All-gather every rank's rows and routing (and padding flags), compute this rank's
experts on all of them, reduce-scatter the partial outputs back. Every rank sees every row: padded rows travel
whether masked or not (all_gather needs equal row counts, which DP padding provides); the mask only removes their
routes, so they cost no expert work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.dispatch.base import (DispatchPath, Dispatched, ReceivedRows, all_gather_rows, effective_ids,
                                    local_ids, meta_weights, pack_meta, reduce_scatter_rows)


@dataclass
class AGRSHandle:
    num_tokens: int
    recv_is_padding: torch.Tensor  # int32 [R*T]: the gathered padding flags (0 when no mask was given)


class AGRSPath(DispatchPath):
    name = "agrs"
    receives = "all"
    graph_capturable = True

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay = self.layout
        R = lay.world_size
        T, K = topk_ids.shape
        ids = effective_ids(topk_ids, is_padding)
        flags = is_padding.to(torch.int32) if is_padding is not None else \
            torch.zeros(T, dtype=torch.int32, device=x.device)
        meta = pack_meta(ids, topk_weights, flags)
        recv_x = torch.empty(R * T, x.shape[1], dtype=x.dtype, device=x.device)
        recv_meta = torch.empty(R * T, meta.shape[1], dtype=meta.dtype, device=x.device)
        all_gather_rows(recv_x, x.contiguous(), lay.group, R)
        all_gather_rows(recv_meta, meta, lay.group, R)
        counts = [T] * R
        return Dispatched(recv_x=recv_x, recv_topk_ids=local_ids(recv_meta[:, :K], lay),
                          recv_topk_weights=meta_weights(recv_meta, K), num_recv=R * T,
                          handle=AGRSHandle(T, recv_meta[:, 2 * K]), send_counts=counts, recv_counts=counts)

    def combine(self, expert_out, handle: AGRSHandle, out=None):
        lay = self.layout
        if out is None:
            out = torch.empty(handle.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                              device=expert_out.device)
        reduce_scatter_rows(out, expert_out.contiguous(), lay.group, lay.world_size)
        return out

    def received(self, d: Dispatched) -> ReceivedRows:
        T = d.handle.num_tokens
        n = d.recv_x.shape[0]
        dev = d.recv_x.device
        idx = torch.arange(n, device=dev)
        return ReceivedRows(row_index=idx, src_rank=idx // T, src_row=idx % T)

    def combine_recv_rows(self, d: Dispatched) -> int:
        # reduce-scatter: this rank's T output rows get a partial sum from each of the R ranks
        return d.handle.num_tokens * self.layout.world_size

    def wire_row_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + (2 * self.top_k + 1) * 4
