"""Routing helpers the stand-ins share (written for them, independent of moebench's references)."""

import torch


def grouped_select(selection, scores, num_expert_group, topk_group, topk):
    """noaux_tc selection: groups by the sum of their top-2 selection scores, then top-k experts in kept groups;
    returns (scores at the ids, ids)."""
    T, E = selection.shape
    grouped = selection.view(T, num_expert_group, E // num_expert_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros(T, num_expert_group, dtype=torch.bool).scatter_(1, kept, True)
    masked = torch.where(keep.repeat_interleave(E // num_expert_group, dim=1), selection,
                         torch.full_like(selection, float("-inf")))
    ids = masked.topk(topk, dim=-1).indices
    return scores.gather(1, ids), ids


def align_segments(flat_ids, num_buckets, block_size, bucket_of):
    """(routes per bucket in kernel order, padded counts): the routes of bucket b in descending flat order (as an
    atomics-based kernel may leave them)."""
    buckets = [[] for _ in range(num_buckets)]
    for i, e in reversed(list(enumerate(flat_ids.tolist()))):
        b = bucket_of(e)
        if b is not None:
            buckets[b].append(i)
    padded = [(len(r) + block_size - 1) // block_size * block_size for r in buckets]
    return buckets, padded
