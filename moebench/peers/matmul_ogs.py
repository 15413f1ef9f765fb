"""triton_kernels' matmul_ogs as an experts peer (library "triton_kernels": OpenAI's MoE grouped GEMM, pure Python
and Triton, installed from the Triton repository's python/triton_kernels at a Triton tag, as vLLM does):

  fused_experts.triton_kernels  routing metadata from moebench's top-k ids (bitmatrix -> SparseMatrix -> ragged
                                metadata -> RoutingData, GatherIndx, ScatterIndx), then two matmul_ogs calls: gate/up
                                with the gather and triton_kernels' SwiGLU fused, down with the scatter, the top-k
                                weights (gammas) and the reduction over the slots; bf16 in, fp32 accumulation, bf16
                                out

The calls are vLLM's triton_kernels backend (model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py
at 0221ab43: make_routing_data, triton_kernel_fused_experts, its "v3.6.0+" API generation, where
triton_kernels.routing is gone) and triton_kernels' own bench (python/triton_kernels/bench/bench_mlp.py):
  matmul_ogs(x, w1 [E, H, 2I], b1, routing_data, gather_indx=..., precision_config=..., fused_activation=SwiGLU,
             y=[1, T*K, I])
  matmul_ogs(h [T*K, I], w2 [E, I, H], None, routing_data, scatter_indx=..., precision_config=...,
             gammas=routing_data.gate_scal, y=[1, T, H])
Sources read (triton-lang/triton): python/triton_kernels/triton_kernels/matmul_ogs.py at 02adf8fd (RoutingData,
GatherIndx, ScatterIndx, FusedActivation, PrecisionConfig, matmul_ogs, reduce_grouped), tensor.py at 022bb95d
(Bitmatrix, BIT, SparseMatrix, make_ragged_tensor_metadata), swiglu_details/_swiglu.py at 002402cf, bench_mlp.py at
0206ecf9; the API was matched on the generation vLLM calls "v3.6.0+" (triton_kernels.routing removed in October
2025; matmul_ogs renamed matmul on Triton's main in January 2026, triton-lang/triton#9539). The later `matmul`
generation does not import here, and the peer is skipped saying why.

What the adapter does around the library, all timed:
- skipped routes (-1: padding, non-local): -1 is triton_kernels' sentinel of "no expert" in the top-k ids. Its
  bitmatrix bit is not set, so the metadata leaves the route out of every expert's rows (dispatch index -1), the
  GEMMs never compute it and the reduction skips it; its weight is set to -1, as vLLM does. No route is dropped by
  the adapter.
- the reduction writes only tokens with at least one valid route (reduce_grouped: "if a group has no valid entries,
  nothing is written"): the output is zeroed before the call (a memset of T x H bf16).
- triton_kernels' SwiGLU is OpenAI's (gate, linear interleaved column by column; s = gate * sigmoid(alpha * gate);
  out = s * (linear + 1); both clipped at `limit`). moebench's experts compute silu(gate) * up, so the adapter runs
  it with alpha 1, limit the fp32 maximum (no clipping), the gate/up weights interleaved, and a bias of -1 on the
  linear columns (fp32, added before the activation): s * ((up - 1) + 1). The interleaved weights and the bias are
  made once per weights (untimed), as a serving stack converts weights at load time.
- the top-k weights go in as bf16 (vLLM's make_routing_data).
Two API generations run: v3.6.0's (above) and v3.5.1's, the copy vLLM 0.33.0 bundles as
`vllm.third_party.triton_kernels`, whose routing metadata comes from `triton_kernels.routing.routing_from_bitmatrix`
(bitmatrix, bf16 weights with -1 at skipped routes, int16 ids; vLLM's make_routing_data for that generation, read in
vLLM 0.33.0's wheel) and whose Bitmatrix takes no dtype. An installed `triton_kernels` comes first, else vLLM's copy
(aliased as `triton_kernels`, as vLLM does: its modules import themselves by that name); the record's
`adapter_status` names the copy and `matmul_ogs_generation` the API. The tests use
tests/standins/triton_kernels_standin.py (the v3.6.0 generation).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moebench.peers._lib import Library, accepts, register_adapter

__all__ = ["TRITON_KERNELS", "generation", "interleave_gate_up", "linear_bias", "pack_bitmatrix", "make_matmul_ogs"]

NO_CLIP = float(torch.finfo(torch.float32).max)  # the SwiGLU's limit: every finite value passes
SKIPPED = ("-1 in the top-k ids (triton_kernels' sentinel): no bitmatrix bit, dispatch index -1, never computed, "
           "skipped by the reduction; weight -1 as vLLM sets it")


def _load():
    from triton_kernels.matmul_ogs import (FnSpecs, FusedActivation, GatherIndx, PrecisionConfig, RoutingData,
                                           ScatterIndx, matmul_ogs)
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import BIT, Bitmatrix

    lib = SimpleNamespace(matmul_ogs=matmul_ogs, RoutingData=RoutingData, GatherIndx=GatherIndx,
                          ScatterIndx=ScatterIndx, FnSpecs=FnSpecs, FusedActivation=FusedActivation,
                          PrecisionConfig=PrecisionConfig, swiglu_fn=swiglu_fn, BIT=BIT, Bitmatrix=Bitmatrix)
    try:  # the v3.6.0 generation: routing metadata from a SparseMatrix
        from triton_kernels.tensor import SparseMatrix, make_ragged_tensor_metadata

        lib.SparseMatrix, lib.make_ragged_tensor_metadata = SparseMatrix, make_ragged_tensor_metadata
    except ImportError:  # the v3.5.1 generation (the copy vLLM 0.33.0 bundles): its routing module
        from triton_kernels.routing import routing_from_bitmatrix

        lib.routing_from_bitmatrix = routing_from_bitmatrix
    return lib


TRITON_KERNELS = Library("triton_kernels", "triton_kernels", _load, vendored=("vllm.third_party.triton_kernels",))


def generation(lib) -> str:
    """The triton_kernels API generation of `lib`: "v3.6.0" (SparseMatrix) or "v3.5.1" (routing_from_bitmatrix)."""
    return "v3.6.0" if hasattr(lib, "SparseMatrix") else "v3.5.1"


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """moebench's [E, 2I, H] (gate rows, then up rows) -> matmul_ogs' w1 [E, H, 2I]: column 2j gate j, 2j + 1 up j,
    stored K-contiguous (stride 1 along H), as bench_mlp.quantize_weight lays bf16 weights out."""
    E, two_i, H = w13.shape
    inter = two_i // 2
    return torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(E, two_i, H).transpose(1, 2)


def linear_bias(num_experts: int, intermediate: int, device) -> torch.Tensor:
    """fp32 [E, 2I]: 0 on the gate columns, -1 on the linear ones, cancelling the SwiGLU's linear + 1."""
    bias = torch.zeros(num_experts, intermediate, 2, dtype=torch.float32, device=device)
    bias[:, :, 1] = -1.0
    return bias.reshape(num_experts, 2 * intermediate)


def pack_bitmatrix(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """uint32 [T, ceil(E / 32)]: bit e % 32 of word e // 32 set for every valid id e of the row (-1: none). A row's
    valid ids are distinct experts, so adding their bits is or-ing them."""
    T, _ = topk_ids.shape
    words = -(-num_experts // 32)
    ids = topk_ids.long()
    valid = ids >= 0
    word = torch.where(valid, ids // 32, 0)
    bit = torch.where(valid, torch.ones_like(ids) << (ids.clamp_min(0) % 32), 0)
    packed = torch.zeros(T, words, dtype=torch.int64, device=topk_ids.device).scatter_add_(1, word, bit)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32).view(torch.uint32)


def _activation(lib):
    """triton_kernels' SwiGLU with alpha 1 and no clipping; reduction_n=2 where FnSpecs takes it (v3.6), else the
    older FusedActivation's third field."""
    if accepts(lib.FnSpecs, "reduction_n"):
        return lib.FusedActivation(lib.FnSpecs("swiglu", lib.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                   (1.0, NO_CLIP))
    return lib.FusedActivation(lib.FnSpecs("swiglu", lib.swiglu_fn, ("alpha", "limit")), (1.0, NO_CLIP), 2)


def _ragged_sizes(ragged):
    """The per-expert row counts of the ragged metadata (slice_sizes; block_sizes in the generation vLLM reads)."""
    for name in ("slice_sizes", "block_sizes"):
        if getattr(ragged, name, None) is not None:
            return getattr(ragged, name)
    raise AttributeError("triton_kernels' ragged metadata has neither slice_sizes nor block_sizes")


def make_matmul_ogs(lib):
    act = _activation(lib)
    legacy = generation(lib) == "v3.5.1"
    precision = lib.PrecisionConfig()
    prepared: dict = {}

    def weights(w13, w2):
        key = (w13.data_ptr(), w2.data_ptr(), tuple(w13.shape))
        if key not in prepared:  # the first, untimed call: the weights as a serving stack loads them
            prepared.clear()
            E, two_i, _ = w13.shape
            prepared[key] = (interleave_gate_up(w13), linear_bias(E, two_i // 2, w13.device), w2.transpose(1, 2))
        return prepared[key]

    def routing(topk_ids, topk_weights, num_experts):
        T, K = topk_ids.shape
        ids = topk_ids.to(torch.int16)
        words = -(-num_experts // 32)
        vals = torch.where(topk_ids < 0, -1.0, topk_weights.to(torch.bfloat16)).to(torch.bfloat16)
        if legacy:  # v3.5.1: a Bitmatrix without dtype (its row sums' scratchpad made in the call), then routing
            mask = lib.Bitmatrix(pack_bitmatrix(topk_ids, num_experts), shape=[T, words * 32], shape_max=[T, None],
                                 scratchpad=None)
            return lib.routing_from_bitmatrix(mask, vals, ids, num_experts, K)
        mask = lib.Bitmatrix(pack_bitmatrix(topk_ids, num_experts), dtype=lib.BIT, shape=[T, words * 32],
                             shape_max=[T, None])
        sparse = lib.SparseMatrix(indx=ids, vals=vals, mask=mask)
        dispatch, combine = sparse.mask_metadata.row_sorted_indx, sparse.mask_metadata.col_sorted_indx
        ragged = lib.make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
        data = lib.RoutingData(vals.flatten()[combine], _ragged_sizes(ragged), num_experts, K, ragged)
        return data, lib.GatherIndx(combine, dispatch), lib.ScatterIndx(dispatch, combine)

    def fn(x, w13, w2, topk_weights, topk_ids, *, out=None):
        w1, b1, w2_t = weights(w13, w2)
        T, K = topk_ids.shape
        E, two_i, H = w13.shape
        if out is None:
            out = torch.empty(T, H, dtype=x.dtype, device=x.device)
        inter = fn.buffers.get((T, K, two_i))
        if inter is None:
            inter = fn.buffers[(T, K, two_i)] = torch.empty(1, T * K, two_i // 2, dtype=x.dtype, device=x.device)
        data, gather, scatter = routing(topk_ids, topk_weights, E)
        lib.matmul_ogs(x, w1, b1, data, gather_indx=gather, precision_config=precision, fused_activation=act,
                       y=inter)
        out.zero_()  # tokens without a valid route are not written by the reduction
        lib.matmul_ogs(inter.view(T * K, two_i // 2), w2_t, None, data, scatter_indx=scatter,
                       precision_config=precision, gammas=data.gate_scal, y=out.view(1, T, H))
        return out
    fn.buffers = {}
    fn.info = {"matmul_ogs_generation": generation(lib), "matmul_ogs_skipped_routes": SKIPPED,
               "matmul_ogs_swiglu": "triton_kernels' SwiGLU, alpha 1, no clipping, -1 bias on the linear columns "
                                    "(silu(gate) * up)",
               "matmul_ogs_zeroed_out": "output zeroed before the call (timed): the reduction skips tokens with no "
                                        "valid route"}
    return fn


register_adapter(TRITON_KERNELS, "fused_experts", "triton_kernels", "matmul_ogs", make_matmul_ogs,
                 "triton_kernels matmul_ogs (OpenAI's MoE grouped GEMM, vLLM's triton_kernels backend): routing "
                 "metadata from the ids, gather + SwiGLU, scatter + weights + slot reduction; bf16; -1 routes are "
                 "its sentinel")
