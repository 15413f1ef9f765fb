"""FlashInfer's DeepSeek-V3 router as a peer (library "flashinfer"), checked against moebench's reference first.

  grouped_topk.flashinfer  flashinfer.fused_moe.fused_topk_deepseek(scores, bias, n_group, topk_group, topk,
                           routed_scaling_factor, topk_values, topk_indices, launch_with_pdl=True): sigmoid(logits)
                           + bias, top-2 group scores, renormalised and scaled, written into moebench's
                           (weights, ids) buffers. Points with softmax scoring, without bias or without renormalize
                           are refused; it takes no mask, so padded rows are set to -1 / 0.0 after the call.

The op writes its outputs in place into topk_values / topk_indices (fp32 / int32 here) and has no sentinel or mask
of its own; its group score is the sum of the top-2 biased scores, its weights sigmoid(scores) renormalised then
scaled; a backend check refuses some shapes (e.g. n_group = 1 allows topk <= 8). launch_with_pdl is passed by
keyword because newer versions add an optional argument after it.

Not run against a real FlashInfer by moebench's tests: they use tests/standins/flashinfer_standin.py, a stand-in
with this call signature.
"""

from __future__ import annotations

from types import SimpleNamespace

from moebench.peers._lib import Library, register_adapter, router_after, router_out


def _load():
    from flashinfer.fused_moe import fused_topk_deepseek

    return SimpleNamespace(fused_topk_deepseek=fused_topk_deepseek)


FLASHINFER = Library("flashinfer", "flashinfer", _load)


def make_fused_topk_deepseek(lib):
    op = lib.fused_topk_deepseek

    def fn(logits, top_k, num_expert_group, topk_group, scoring="softmax", bias=None, renormalize=True,
           routed_scaling_factor=1.0, is_padding=None, *, out=None):
        weights, ids = router_out(logits, top_k, out)
        # by keyword: a version whose ninth argument is something else fails loudly instead of taking True
        op(logits, bias, num_expert_group, topk_group, top_k, float(routed_scaling_factor), weights, ids,
           launch_with_pdl=True)
        return router_after(weights, ids, is_padding)
    return fn


def _problem(p):
    if p.scoring != "sigmoid" or not p.bias or not p.renormalize:
        return "scoring/bias/renormalize: fused_topk_deepseek is sigmoid + bias + renormalised routing only"
    return None


register_adapter(FLASHINFER, "grouped_topk", "flashinfer", "fused_topk_deepseek", make_fused_topk_deepseek,
                 "FlashInfer fused_topk_deepseek (DeepSeek-V3 noaux_tc router); padded rows masked after",
                 validate=_problem)
