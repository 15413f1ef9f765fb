"""The benchmark's expert and the single-process references every dispatch path is checked against.

`scaled_expert` is a cheap, exactly reproducible stand-in for the experts; `scaled_expert_reference` is what one
process holding every expert computes. `gather_inputs` collects every rank's inputs, `expected_received` says
which rows a rank must receive, `check_received` compares what a path received with that bitwise, and
`count_padding_received` / `padded_rows_sent` count the padded rows a path moved (the mask's effect).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.check import CheckResult, compare_exact
from moebench.dispatch.base import Dispatched, DispatchPath, EPLayout, ReceivedRows, local_ids, token_in_rank
from moebench.dispatch.comm import all_gather_rows


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
                            local_experts: int) -> torch.Tensor:
    """What one process holding every expert computes for rows x (global ids, -1 skipped): each expert scales by
    (its local index on its owner + 1), summed over all slots in fp32, rounded once."""
    ids = topk_ids.to(torch.int64)
    local = torch.where(ids >= 0, ids % local_experts, torch.full_like(ids, -1))
    return scaled_expert(x, local, topk_weights)


@dataclass
class GatheredInputs:
    """Every rank's inputs, for the single-process reference (equal T per rank)."""

    x: torch.Tensor  # [ep_size, T, H]
    topk_ids: torch.Tensor  # [ep_size, T, K] global, as given to dispatch
    topk_weights: torch.Tensor  # [ep_size, T, K]
    is_padding: torch.Tensor  # [ep_size, T] bool: which rows are padding (whether or not the path was told)
    mask_aware: bool  # was is_padding given to dispatch


def gather_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  is_padding: torch.Tensor, mask_aware: bool, layout: EPLayout) -> GatheredInputs:
    ep_size = layout.ep_size
    T, K = topk_ids.shape

    def gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = torch.empty((ep_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_rows(out, t, layout.group, ep_size)
        return out.view((ep_size,) + tuple(t.shape))

    return GatheredInputs(x=gather(x), topk_ids=gather(topk_ids.to(torch.int32)),
                          topk_weights=gather(topk_weights.to(torch.float32)),
                          is_padding=gather(is_padding.to(torch.uint8)).bool(), mask_aware=mask_aware)


def expected_received(g: GatheredInputs, layout: EPLayout, receives: str) -> ReceivedRows:
    """Which rows this rank must receive (sorted by source rank, source row[, local expert])."""
    ep_size, T, K = g.topk_ids.shape
    ids = g.topk_ids.clone()
    if g.mask_aware:
        ids[g.is_padding] = -1
    local = local_ids(ids, layout)  # [ep_size, T, K]
    src_rank = torch.arange(ep_size, device=ids.device).view(ep_size, 1).expand(ep_size, T)
    src_row = torch.arange(T, device=ids.device).view(1, T).expand(ep_size, T)
    if receives == "all":
        keep = torch.ones(ep_size, T, dtype=torch.bool, device=ids.device)
    elif receives == "token":
        keep = (local >= 0).any(dim=2)
    elif receives == "slot":
        sel = (local >= 0).nonzero()  # (src_rank, src_row, k), row-major: sorted by rank, row, slot
        e = local[sel[:, 0], sel[:, 1], sel[:, 2]].to(torch.int64)
        # sort within a token by local expert (paths order slots by expert, not by k)
        key = (sel[:, 0] * T + sel[:, 1]) * layout.local_experts + e
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
    layout = path.layout
    exp = expected_received(g, layout, path.receives)
    got = path.received(d)
    ep_size, T, K = g.topk_ids.shape
    E_loc = layout.local_experts
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


def padded_rows_sent(path: DispatchPath, ids: torch.Tensor, is_padding: torch.Tensor) -> int:
    """Padded rows this rank puts on the wire (per destination, own rank included); `ids`: the effective routing
    (base.effective_ids)."""
    lay = path.layout
    if path.receives == "all":
        return int(is_padding.sum()) * lay.ep_size
    if path.receives == "slot":
        return int(((ids >= 0) & is_padding.unsqueeze(1)).sum())
    return int((token_in_rank(ids, lay) & is_padding.unsqueeze(1)).sum())
