"""The mask a mask-aware impl is handed at a sweep point: the producer's own mask, or one of the two ways an
engine got it wrong (the seed-001 PCP gather and the seed-002 dual-batch-overlap review).

`Batch.is_padding` is always the truth for the rows the router sees; this module decides what the router is
*given* (`Batch.mask`):
  pcp_mask: gathered  the gathered mask of the P*N gathered rows (the fix).
            local     this rank's own N-entry mask with the P*N gathered rows (before the fix): the router's size
                      check raises "is_padding size mismatch" for P > 1 (recorded as a failed point, not a crash).
  dbo_mask: sliced    each micro-batch gets its slice of the full-batch mask (the fix).
            full      the full-batch mask handed to one micro-batch: the size check raises.
            none      the micro-batch context is built without a mask (the bug the review found): the padded
                      rows of the micro-batch are routed like real tokens.
With `mask: false` nothing is handed to the router whatever these say. moebench.run.sweep.params_problem refuses either
knob away from its producer.
"""

from __future__ import annotations

import torch

from moebench.inputs.padding import run_producer
from moebench.params import Params


def point_masks(p: Params, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(is_padding, router_mask) of point `p`, from one run of its producer: which routed rows are padding, and
    what the mask-aware impls receive."""
    is_padding, before = run_producer(p, device)
    return is_padding, _handed(p, is_padding, before)


def _handed(p: Params, is_padding: torch.Tensor, before: torch.Tensor) -> torch.Tensor | None:
    """`before` is the mask the rank held before the producer's gather (pcp) or split (dbo)."""
    if not p.mask:
        return None
    if p.padding_producer == "pcp" and p.pcp_mask == "local":
        return before
    if p.padding_producer == "dbo" and p.dbo_mask == "none":
        return None
    if p.padding_producer == "dbo" and p.dbo_mask == "full":
        return before
    return is_padding
