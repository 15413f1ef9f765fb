"""`deepep_v2`, `deepep_v2_expand`: DeepEP's V2 `ElasticBuffer` behind the moebench dispatch interface, when
`deep_ep` imports (detected in moebench.dispatch.deepep).

`do_cpu_sync=False` (CUDA-graph friendly): worst-case receive buffers sized by `num_max_tokens_per_rank`, rows past
the device-side count uninitialised and neutralised with `globalize_recv_topk_idx` (the vLLM fix).
`DeepEPV2Path` (do_expand=False): one row per (token, rank) with K local ids; `DeepEPV2ExpandPath`
(do_expand=True): one row per (token, expert) slot grouped by expert, combine sums the slots.

The calls follow DeepEP's public repository (deep_ep/buffers/elastic.py and its tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebench.dispatch.base import (
    Dispatched,
    DispatchPath,
    EPLayout,
    ReceivedRows,
    dispatch_path,
    effective_ids,
    token_in_rank,
)
from moebench.dispatch.deepep import available_here, combined_into, deep_ep, process_group, require, topk_idx_dtype
from moebench.dispatch.pack import CapacityKnobs


@dataclass
class V2Handle:
    ep_handle: Any
    num_tokens: int
    ids: torch.Tensor


@dispatch_path("deepep_v2", description="DeepEP V2 ElasticBuffer, do_expand=False, no CPU sync; rows past the "
                                         "count neutralised")
class DeepEPV2Path(DispatchPath):
    receives = "token"
    graph_capturable = True  # do_cpu_sync=False: counts stay on the device
    buffers_sized_by_max_tokens = True  # worst-case receive buffers
    do_expand = False

    def __init__(self, layout: EPLayout, *, hidden: int, top_k: int, num_max_tokens_per_rank: int,
                 dtype=torch.bfloat16, device="cuda"):
        super().__init__(layout, hidden=hidden, top_k=top_k, dtype=dtype, device=device)
        require("v2")
        self.max_tokens = int(num_max_tokens_per_rank)
        self.buffer = deep_ep.ElasticBuffer(process_group(layout), num_max_tokens_per_rank=self.max_tokens,
                                            hidden=hidden, num_topk=top_k, use_fp8_dispatch=False,
                                            explicitly_destroy=True)
        self.num_sms = self.buffer.get_theoretical_num_sms(layout.num_experts, top_k)

    @classmethod
    def available(cls, ctx) -> str | None:
        return available_here("v2", ctx)

    @classmethod
    def from_point(cls, layout, p, topk_ids, is_padding, device) -> "DeepEPV2Path":
        return cls(layout, hidden=p.hidden, top_k=p.top_k,
                   num_max_tokens_per_rank=p.knobs(CapacityKnobs).num_max_tokens_per_rank,
                   dtype=torch.bfloat16, device=device)

    def record_info(self, p) -> dict:
        return {"num_max_tokens_per_rank": p.knobs(CapacityKnobs).num_max_tokens_per_rank, "do_expand": self.do_expand}

    def _num_recv(self, h) -> torch.Tensor:
        return h.psum_num_recv_tokens_per_scaleup_rank[-1:]  # device: total received (token, rank) rows

    def dispatch(self, x, topk_ids, topk_weights, is_padding=None) -> Dispatched:
        from moebench.kernels.globalize_recv_topk_idx import globalize_recv_topk_idx

        lay = self.layout
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} rows exceed num_max_tokens_per_rank={self.max_tokens}")
        ids = effective_ids(topk_ids, is_padding)
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = self.buffer.dispatch(
            x, topk_idx=ids.to(topk_idx_dtype()), topk_weights=topk_weights.to(torch.float32),
            num_experts=lay.num_experts, num_max_tokens_per_rank=self.max_tokens, num_sms=self.num_sms,
            do_cpu_sync=False, do_expand=self.do_expand)
        E_loc = lay.local_experts
        if not self.do_expand:
            # Rows past the device-side count are uninitialised: validate ids as local (offset 0, bound E/R)
            # and drop rows >= num_recv, exactly the neutralisation vLLM applies to this buffer.
            recv_ids = globalize_recv_topk_idx(recv_topk_idx, self._num_recv(handle), 0, E_loc)
            recv_w = recv_topk_weights
            num_recv = self._num_recv(handle)
        else:
            # One row per (token, expert) slot, grouped by expert: psum[i] = end of expert i's rows (alignment 1).
            psum = handle.psum_num_recv_tokens_per_expert.to(torch.int64)
            slots = torch.arange(recv_x.shape[0], device=recv_x.device)
            expert = torch.bucketize(slots, psum, right=True)
            recv_ids = expert.unsqueeze(1)
            globalize_recv_topk_idx(recv_ids, psum[-1:], 0, E_loc)  # slots past the total -> -1
            recv_w = recv_topk_weights.unsqueeze(1)
            num_recv = psum[-1:]
        return Dispatched(recv_x=recv_x, recv_topk_ids=recv_ids, recv_topk_weights=recv_w, num_recv=num_recv,
                          handle=V2Handle(handle, x.shape[0], ids))

    def combine(self, expert_out, handle: V2Handle, out=None):
        combined_x, _, _ = self.buffer.combine(expert_out, handle=handle.ep_handle)
        return combined_into(combined_x, out)

    def received(self, d: Dispatched) -> ReceivedRows:
        h = d.handle.ep_handle
        n = int(self._num_recv(h).item())
        meta = h.recv_src_metadata[:n].to(torch.int64).cpu()
        src_global = meta[:, 0]  # src_rank * num_max_tokens_per_rank + row
        if not self.do_expand:
            return ReceivedRows(row_index=torch.arange(n), src_rank=src_global // self.max_tokens,
                                src_row=src_global % self.max_tokens)
        slot = meta[:, 2:]  # [n, K] expanded slot of each (token, k), -1 = none
        tok, k = (slot >= 0).nonzero(as_tuple=True)
        rows = slot[tok, k]
        psum = h.psum_num_recv_tokens_per_expert.to(torch.int64).cpu()
        expert = torch.bucketize(rows, psum, right=True)
        return ReceivedRows(row_index=rows, src_rank=src_global[tok] // self.max_tokens,
                            src_row=src_global[tok] % self.max_tokens, local_expert=expert)

    def stats(self, d: Dispatched):
        got = self.received(d)
        R = self.layout.ep_size
        d.recv_counts = torch.bincount(got.src_rank, minlength=R)
        if self.do_expand:
            ids = d.handle.ids.to(torch.int64).cpu()
            dest = torch.where(ids >= 0, ids // self.layout.local_experts, R)
            d.send_counts = torch.bincount(dest.flatten(), minlength=R + 1)[:R]
        else:
            d.send_counts = token_in_rank(d.handle.ids, self.layout).sum(0)
        return super().stats(d)

    def row_payload_bytes(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.hidden * elt + (4 if self.do_expand else self.top_k * 8)

    def wire_recv_rows(self, d: Dispatched) -> int:
        return d.recv_x.shape[0]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None


@dispatch_path("deepep_v2_expand", description="DeepEP V2 ElasticBuffer, do_expand=True (one row per expert slot), "
                                                "no CPU sync")
class DeepEPV2ExpandPath(DeepEPV2Path):
    receives = "slot"
    do_expand = True
