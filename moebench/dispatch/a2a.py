"""`a2a`: exact-size all-to-all. Count exchange (one host sync), permutation of rows by destination rank, one
all_to_all_single for the hidden rows and one for the routing metadata; combine sends the expert outputs back and
un-permutes them with a scatter-sum by source row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.dispatch.base import (DispatchPath, Dispatched, EPLayout, ReceivedRows, all_to_all_single,
                                    effective_ids, local_ids, meta_weights, pack_meta, token_in_rank)


@dataclass
class A2AHandle:
    send_index: torch.Tensor  # int64 [S]: source row of each sent row, destination-major, rows ascending
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int
    recv_src_row: torch.Tensor  # int32 [N]: row index on its source rank


def destination_order(in_rank: torch.Tensor, num_sent: int) -> torch.Tensor:
    """Rows to send, grouped by destination rank (ascending row within a destination), as a gather index.

    Sync-free: the slot of each (dest, row) pair is a running count in destination-major order; pairs that are
    not sent are scattered to a dump slot past the end.
    """
    T, R = in_rank.shape
    flat = in_rank.t().reshape(-1)  # [R*T], destination-major
    slot = torch.cumsum(flat, 0) - 1
    target = torch.where(flat, slot, torch.full_like(slot, num_sent))
    rows = torch.arange(R * T, device=in_rank.device) % T
    index = torch.empty(num_sent + 1, dtype=torch.int64, device=in_rank.device)
    index.scatter_(0, target, rows)
    return index[:num_sent]


class A2APath(DispatchPath):
    name = "a2a"
    receives = "token"
    graph_capturable = False  # the split sizes are read back on the host

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        lay: EPLayout = self.layout
        R = lay.world_size
        T, K = topk_ids.shape
        ids = effective_ids(topk_ids, is_padding)
        in_rank = token_in_rank(ids, lay)
        send_counts = in_rank.sum(0, dtype=torch.int32)
        recv_counts = torch.empty_like(send_counts)
        all_to_all_single(recv_counts, send_counts, group=lay.group, world_size=R)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).cpu().tolist()  # the host sync
        S, N = sum(send_splits), sum(recv_splits)

        send_index = destination_order(in_rank, S)
        send_x = x.index_select(0, send_index)
        meta = pack_meta(ids, topk_weights, torch.arange(T, dtype=torch.int32, device=x.device))
        send_meta = meta.index_select(0, send_index)
        recv_x = torch.empty(N, x.shape[1], dtype=x.dtype, device=x.device)
        recv_meta = torch.empty(N, meta.shape[1], dtype=meta.dtype, device=x.device)
        all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=lay.group, world_size=R)
        all_to_all_single(recv_meta, send_meta, recv_splits, send_splits, group=lay.group, world_size=R)

        recv_ids = local_ids(recv_meta[:, :K], lay)  # global ids travel; the receiver localises
        handle = A2AHandle(send_index, send_splits, recv_splits, T, recv_meta[:, 2 * K])
        return Dispatched(recv_x=recv_x, recv_topk_ids=recv_ids, recv_topk_weights=meta_weights(recv_meta, K),
                          num_recv=N, handle=handle, send_counts=send_splits, recv_counts=recv_splits)

    def combine(self, expert_out, handle: A2AHandle, out=None):
        lay = self.layout
        S = sum(handle.send_splits)
        back = torch.empty(S, expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device)
        all_to_all_single(back, expert_out, handle.send_splits, handle.recv_splits, group=lay.group,
                          world_size=lay.world_size)
        if out is None:
            out = torch.zeros(handle.num_tokens, expert_out.shape[1], dtype=expert_out.dtype,
                              device=expert_out.device)
        else:
            out.zero_()
        out.index_add_(0, handle.send_index, back)  # rows no rank computed stay 0
        return out

    def received(self, d: Dispatched) -> ReceivedRows:
        h: A2AHandle = d.handle
        dev = d.recv_x.device
        src_rank = torch.repeat_interleave(torch.arange(self.layout.world_size, device=dev),
                                           torch.tensor(h.recv_splits, device=dev))
        return ReceivedRows(row_index=torch.arange(d.recv_x.shape[0], device=dev), src_rank=src_rank,
                            src_row=h.recv_src_row.to(torch.int64))

    def wire_row_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + (2 * self.top_k + 1) * 4
