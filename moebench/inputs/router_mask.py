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
With `mask: false` nothing is handed to the router whatever these say. moebench.sweep.params_problem refuses either
knob away from its producer.
"""

from __future__ import annotations

import torch

from moebench.inputs.padding import pcp_rank_masks, ratio_mask
from moebench.params import Params


def router_mask(p: Params, is_padding: torch.Tensor) -> torch.Tensor | None:
    """What the mask-aware impls receive for point `p`, whose routed rows have the mask `is_padding`."""
    if not p.mask:
        return None
    if p.padding_producer == "pcp" and p.pcp_mask == "local":
        return pcp_rank_masks(p.num_tokens, p.producer_size, p.padding_ratio, is_padding.device)[0]
    if p.padding_producer == "dbo" and p.dbo_mask == "none":
        return None
    if p.padding_producer == "dbo" and p.dbo_mask == "full":
        return ratio_mask(p.num_tokens, p.padding_ratio, is_padding.device)
    return is_padding
