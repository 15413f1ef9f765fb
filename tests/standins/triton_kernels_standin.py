"""Stand-in for OpenAI's triton_kernels (the names moebench.peers.matmul_ogs uses), written from triton-lang/triton
python/triton_kernels at the generation vLLM calls "v3.6.0+": triton_kernels/matmul_ogs.py at 02adf8fd (RoutingData,
GatherIndx, ScatterIndx, FnSpecs(reduction_n), FusedActivation, PrecisionConfig, matmul_ogs and its reduce_grouped),
tensor.py at 022bb95d (BIT, Bitmatrix, SparseMatrix, make_ragged_tensor_metadata), swiglu_details/_swiglu.py at
002402cf, and vLLM's gpt_oss_triton_kernels_moe.py at 0221ab43 (how it builds them). What it copies:
- SparseMatrix(indx, vals, mask).mask_metadata: col_sum from the bitmatrix's bits; col_sorted_indx (each expert's
  routes in flat order, experts in order, then -1) and row_sorted_indx (each route's sorted position, -1 for a route
  with no bit) from the ids. The real kernel counts from the bits and places by the ids: where the two disagree it
  writes past an expert's rows, so this stand-in raises. -1 in the ids is the "no expert" sentinel.
- matmul_ogs with gather: y[0, p] for each sorted position p of an expert's rows = act(x[src[p] // K] @ w[e] +
  bias[e]) in fp32, rounded to y's dtype; positions past the routed rows are not written. With scatter: each routed
  row's x[p] @ w[e] (+ bias) times gammas[p], rounded to y's dtype per route, then summed over the token's valid
  slots in fp32 and rounded again (reduce_grouped); a token without a valid slot is not written. y must have the
  shape matmul_ogs allocates: (1, rows, N / reduction_n).
- swiglu_fn (OpenAI's SwiGLU on interleaved columns): gate clipped above at limit, linear clipped to [-limit, limit],
  s = gate * sigmoid(alpha * gate), out = s * (linear + 1), in fp32.
The v3.5.1 generation (the copy vLLM 0.33.0 bundles, read in its wheel: triton_kernels/routing.py, tensor.py) is
`legacy()`: a Bitmatrix without dtype and with a scratchpad, and routing_from_bitmatrix(bitmatrix, expt_scal,
expt_indx, n_expts_tot, n_expts_act) -> (RoutingData with ExptData(hist, token_offs_raw, ...), GatherIndx(topk_indx,
gate_indx), ScatterIndx(gate_indx, topk_indx)), the same positions as v3.6's metadata (topk_indx = col_sorted,
gate_indx = row_sorted), gate_scal = expt_scal in sorted order.
Only the calls the adapter makes are implemented; any other mode raises NotImplementedError."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

MOEBENCH_STANDIN = "triton_kernels"  # the moebench.peers Library it stands in for


@dataclass
class IntegerType:
    bitwidth: int


BIT = IntegerType(1)


@dataclass
class Bitmatrix:
    storage: torch.Tensor
    dtype: object = None
    shape: list = None
    shape_max: list = None

    def __post_init__(self):
        assert self.dtype == BIT
        if self.storage.dtype != torch.uint32 or self.shape[1] != self.storage.shape[1] * 32:
            raise ValueError("Bitmatrix: uint32 words, 32 columns each")


@dataclass
class BitmatrixMetadata:
    col_sum: torch.Tensor
    col_sorted_indx: torch.Tensor
    row_sorted_indx: torch.Tensor


def _bits(mask: Bitmatrix) -> torch.Tensor:
    words = mask.storage.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((words[:, :, None] >> torch.arange(32)) & 1).reshape(words.shape[0], -1).bool()


def make_bitmatrix_metadata(indx, mask):
    bits = _bits(mask)
    n_rows, n_cols = bits.shape
    ids = indx.long()
    if bool((ids < -1).any()) or bool((ids >= n_cols).any()):
        raise IndexError("make_bitmatrix_metadata: ids must be -1 or a bitmatrix column")
    listed = torch.zeros_like(bits)
    rows = torch.arange(n_rows)[:, None].expand_as(ids)
    listed[rows[ids >= 0], ids[ids >= 0]] = True
    if not torch.equal(listed, bits):
        raise ValueError("make_bitmatrix_metadata: the bitmatrix does not hold exactly the valid ids (the counts come "
                         "from the bits and the positions from the ids: an expert's rows would overrun)")
    flat = ids.reshape(-1)
    key = torch.where(flat >= 0, flat, n_cols)
    order = torch.sort(key, stable=True).indices
    n_valid = int((flat >= 0).sum())
    col_sorted = torch.full_like(flat, -1)
    col_sorted[:n_valid] = order[:n_valid]
    row_sorted = torch.full_like(flat, -1)
    row_sorted[order[:n_valid]] = torch.arange(n_valid)
    return BitmatrixMetadata(bits.sum(dim=0).to(torch.int32), col_sorted.to(torch.int32), row_sorted.to(torch.int32))


@dataclass
class SparseMatrix:
    indx: torch.Tensor
    vals: torch.Tensor
    mask: Bitmatrix

    def __post_init__(self):
        self.mask_metadata = make_bitmatrix_metadata(self.indx, self.mask)


@dataclass
class RaggedTensorMetadata:
    slice_sizes: torch.Tensor
    slice_offs: torch.Tensor


def make_ragged_tensor_metadata(slice_sizes, max_n_blocks):
    sizes = slice_sizes.to(torch.int32)
    return RaggedTensorMetadata(sizes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0, dtype=torch.int32)]))


@dataclass
class GatherIndx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass
class ScatterIndx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass
class RoutingData:
    gate_scal: torch.Tensor = field()
    expt_hist: torch.Tensor = field()
    n_expts_tot: int = field()
    n_expts_act: int = field()
    expt_data: RaggedTensorMetadata = None
    expected_tokens_per_expt: int = field(default=None)


@dataclass(frozen=True)
class FnSpecs:
    name: str
    fn: object
    fn_arg_names: tuple
    fn_arg_do_not_specialize: tuple = ()
    reduction_n: int = 1

    @staticmethod
    def default():
        return FnSpecs("dflt", None, ())


@dataclass(frozen=True)
class FusedActivation:
    specs: FnSpecs = FnSpecs.default()
    fn_args: tuple = ()


@dataclass
class PrecisionConfig:
    max_num_imprecise_acc: int = None
    allow_tf32: bool = True
    out_dtype: torch.dtype = None


def swiglu_fn(input, alpha, limit):
    gate, linear = input[:, 0::2].float(), input[:, 1::2].float()
    if limit is not None:
        gate, linear = gate.clamp(max=limit), linear.clamp(-limit, limit)
    s = gate / (1 + torch.exp(-alpha * gate))
    return s * linear + s


def _routed_rows(routing_data):
    """(expert, first position, row count) of each expert with rows, from the ragged metadata (v3.5.1: ExptData)."""
    data = routing_data.expt_data
    sizes = (data.slice_sizes if hasattr(data, "slice_sizes") else data.hist).tolist()[:routing_data.n_expts_tot]
    offs = (data.slice_offs if hasattr(data, "slice_offs") else data.token_offs_raw).tolist()
    return [(e, offs[e], n) for e, n in enumerate(sizes) if n]


def matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None, precision_config=None,
               betas=None, gammas=None, out_alpha=None, y=None, fused_comm=None, fused_activation=None,
               epilogue=None, y_acc_in=None, inner_routing_data=None):
    if routing_data is None or (gather_indx is None) == (scatter_indx is None) or y is None:
        raise NotImplementedError("stand-in: a routed matmul with either a gather or a scatter, into y")
    if any(a is not None for a in (betas, out_alpha, fused_comm, epilogue, y_acc_in, inner_routing_data)):
        raise NotImplementedError("stand-in: betas, out_alpha, fused comm, epilogues, accumulation not modelled")
    act = fused_activation or FusedActivation()
    if act.specs.fn not in (None, swiglu_fn):
        raise NotImplementedError("stand-in: triton_kernels' own swiglu_fn only")
    if scatter_indx is not None and act.specs.fn is not None:
        raise NotImplementedError("stand-in: an activation with a scatter runs in the reduction, not modelled")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.ndim != 3 or x.shape[-1] != w.shape[1]:
        raise ValueError("matmul_ogs (stand-in): bf16 x [M, K] and w [E, K, N]")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (w.shape[0], w.shape[2])):
        raise ValueError("matmul_ogs: bias fp32 [E, N]")
    n_act = routing_data.n_expts_act
    N = w.shape[2]
    if gather_indx is not None:
        rows_out = gather_indx.src_indx.shape[0]
    else:
        rows_out = scatter_indx.src_indx.shape[0] // n_act
    expected = (1, rows_out, N // act.specs.reduction_n)
    if tuple(y.shape) != expected:
        raise AssertionError(f"matmul_ogs: y has shape {tuple(y.shape)}, the allocation is {expected}")
    per_position = {}
    for e, first, n in _routed_rows(routing_data):
        pos = torch.arange(first, first + n)
        rows = gather_indx.src_indx[pos].long() // n_act if gather_indx is not None else pos
        acc = x[rows].float() @ w[e].float()
        if bias is not None:
            acc = acc + bias[e]
        if gammas is not None:
            acc = acc * gammas[pos].float()[:, None]
        if act.specs.fn is not None:
            acc = act.specs.fn(acc, *act.fn_args)
        per_position[e] = (pos, acc.to(y.dtype))
    if gather_indx is not None:
        for pos, value in per_position.values():
            y[0, pos] = value
        return y
    routed = torch.zeros(x.shape[0], N, dtype=y.dtype)
    for pos, value in per_position.values():
        routed[pos] = value
    slots = scatter_indx.src_indx.long().view(rows_out, n_act)
    for t in range(rows_out):
        valid = slots[t][slots[t] >= 0]
        if valid.numel():
            y[0, t] = routed[valid].float().sum(dim=0).to(y.dtype)
    return y


# --- the v3.5.1 generation ------------------------------------------------------------------------------------------

class LegacyBitmatrix:
    """v3.5.1's Bitmatrix(storage, shape, shape_max=None, scratchpad=None): BIT is implied, no dtype argument."""

    def __init__(self, storage, shape, shape_max=None, scratchpad=None):
        if storage.dtype != torch.uint32 or shape[1] != storage.shape[1] * 32:
            raise ValueError("Bitmatrix: uint32 words, 32 columns each")
        self.storage, self.shape, self.shape_max, self.scratchpad = storage, shape, shape_max, scratchpad


@dataclass
class ExptData:
    hist: torch.Tensor
    token_offs_raw: torch.Tensor
    token_offs_pad: dict = None
    block_pid_map: dict = None


def routing_from_bitmatrix(bitmatrix, expt_scal, expt_indx, n_expts_tot, n_expts_act):
    if expt_indx.dtype != torch.int16 or expt_scal.shape != expt_indx.shape:
        raise ValueError("routing_from_bitmatrix (stand-in): int16 ids and scales of their shape")
    meta = make_bitmatrix_metadata(expt_indx, bitmatrix)
    topk_indx, gate_indx = meta.col_sorted_indx, meta.row_sorted_indx
    gate_scal = expt_scal.reshape(-1)[topk_indx.long().clamp_min(0)]
    hist = meta.col_sum[:n_expts_tot]
    offs = torch.cat([hist.new_zeros(1), hist.cumsum(0, dtype=torch.int32)])
    return (RoutingData(gate_scal, hist, n_expts_tot, n_expts_act, ExptData(hist, offs)),
            GatherIndx(src_indx=topk_indx, dst_indx=gate_indx), ScatterIndx(src_indx=gate_indx, dst_indx=topk_indx))


def legacy() -> SimpleNamespace:
    """The v3.5.1 generation's names (no SparseMatrix, no make_ragged_tensor_metadata)."""
    return SimpleNamespace(MOEBENCH_STANDIN=MOEBENCH_STANDIN, __name__=__name__ + ".legacy", matmul_ogs=matmul_ogs,
                           RoutingData=RoutingData, GatherIndx=GatherIndx, ScatterIndx=ScatterIndx, FnSpecs=FnSpecs,
                           FusedActivation=FusedActivation, PrecisionConfig=PrecisionConfig, swiglu_fn=swiglu_fn,
                           BIT=BIT, Bitmatrix=LegacyBitmatrix, routing_from_bitmatrix=routing_from_bitmatrix)
