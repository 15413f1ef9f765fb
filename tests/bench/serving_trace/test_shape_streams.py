"""A shape's routing figures read off the two streams' prefix sums are exactly those of its batch routed whole, on
every side, fill and EP layout; the batch is the real prefix and the padding the fill makes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from moebench.bench.serving_trace.shape_streams import ShapeStreams
from moebench.bench.serving_trace.shapes import routing_figures
from moebench.inputs import route
from moebench.params import Params


@pytest.mark.parametrize("fill,ep_size,grouped", [("zeros", 4, False), ("repeat", 2, True), ("random", 1, False),
                                                  ("stale", 4, True)])
def test_a_shapes_figures_are_its_batch_routed_whole(fill, ep_size, grouped):
    p = replace(Params(), num_experts=16, top_k=4, hidden=32, intermediate=16, ep_size=ep_size, padding_fill=fill,
                seed=random.randrange(1000),
                **({"num_expert_group": 4, "topk_group": 2, "scoring": "sigmoid", "bias": True} if grouped else {}))
    streams = ShapeStreams(p, torch.device("cpu"), max_real=40, max_pad=30)
    for rows, real in [(1, 0), (7, 7), (12, 5), (40, 40), (50, 20), (30, 0), (69, 40)]:
        sp, batch = streams.batch(rows, real)
        assert batch.logits.shape[0] == rows and int(batch.is_padding.sum()) == rows - real
        assert torch.equal(batch.logits[:real], streams.real.logits[:real])
        if fill == "repeat" and rows > real:
            assert torch.equal(batch.logits[real:], streams.real.logits[:1].expand(rows - real, -1))
        want = {}
        for side in ("masked", "oblivious"):
            _, ids = route(sp, batch, use_mask=side == "masked")
            want[side] = routing_figures(sp, batch, ids)
        gemm, loads, most = streams.figures(rows, real)
        for side in ("masked", "oblivious"):
            assert (gemm[side], loads[side], most[side]) == want[side], (rows, real, side)
    with pytest.raises(ValueError, match="outside the streams"):
        streams.batch(41, 41)
