"""DeepGEMM's grouped contiguous fp8 GEMM as an experts peer (library "deep_gemm"), DeepSeek-style block scales:

  fused_experts.fp8_deepgemm  deep_gemm.m_grouped_fp8_gemm_nt_contiguous for both GEMMs, on the staged rows as they
                              are (group 128, fp32 scales: DeepGEMM's 1x128 activation recipe on sm90) and moebench's
                              128x128 block weights (its weight recipe); the layout, the SwiGLU with its 1x128
                              re-quantisation and the combine through torch.compile, as the torch peers
                              (peers.torch_grouped). The glue has no host sync (the capacity is static); whether the
                              library call has none is unverified (the @gpu test of tests/peers/test_peers_deepgemm.py).

The contiguous layout (compiled, `contiguous_layout`): each expert's routes padded up to a multiple of the alignment
(get_mk_alignment_for_contiguous_layout(), 128 unless set), the experts one after the other, capacity
ceil((T*K + E*(align-1)) / align) * align rows; `m_indices` names each row's expert, -1 for padding and the tail.
Skipped routes (-1, non-local) get no row at all: -1 is DeepGEMM's sentinel for a row of no group.

What was read: deepseek-ai/DeepGEMM v2.6.1 (54e2261, `__version__ = '2.6.1'`): csrc/apis/gemm.hpp,
csrc/apis/layout.hpp, csrc/utils/layout.hpp, csrc/jit_kernels/impls/smxx_layout.hpp, scheduler/gemm.cuh,
tests/test_fp8_fp4.py, tests/generators.py, README. The call: m_grouped_fp8_gemm_nt_contiguous(a=(e4m3 [M, K],
sfa), b=(e4m3 [G, N, K], sfb fp32 [G, N/128, K/128]), d bf16 [M, N], grouped_layout int32 [M], recipe=None, ...,
compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False, ...), an alias of
m_grouped_fp8_fp4_gemm_nt_contiguous. On sm90 the default recipe is (1, 128, 128): sfa fp32 [M, K/128], which
DeepGEMM needs MN-major and TMA-aligned (stride 1 along M, align(M, 4) between columns; README: "the LHS scaling
factor is required to have a TMA-aligned and transposed layout"); any other sfa layout it transposes itself with a
JIT kernel inside the call. This adapter's compiled glue writes both GEMMs' sfa in that layout, so nothing is
transposed inside a timed call (info "deepgemm_sfa_layout" says which happened). A 64-row half-block whose first
row is -1 is not computed (scheduler is_computation_valid); its d rows are never read here. UE8M0 (use_ue8m0) is
the sm100 recipe: there the library packs scales into UE8M0 and rejects fp32 sfa with disable_ue8m0_cast=True, and
moebench's fp32 scales are not powers of two, so the peer runs on sm90 only (available() says so elsewhere) and
passes disable_ue8m0_cast=True as DeepGEMM's own tests do for fp32 scales.

Which copy runs: an installed `deep_gemm` first, else the copy vLLM's wheel bundles (`vllm.third_party.deep_gemm`),
the order vLLM itself imports them in; the record's `adapter_status` names the copy, its path and version. Run
against the real library: DeepGEMM 2.8.1 as vLLM 0.33.0 bundles it (its TORCH_LIBRARY extension loads on torch 2.11,
its JIT compiles each shape on the first call, outside the timed region). DeepGEMM is not installable from the
package index and is never committed, like DeepEP. The tests use tests/standins/deep_gemm_standin.py, a stand-in
with this call's signature and layout rules.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moebench.bench.experts_fp8 import Fp8Inputs, Fp8Operands, build_fp8_outside, fp8_layout_problem
from moebench.kernels.fp8_quant import ACT_GROUP, E4M3, dequantize_staged, dequantize_weights, requantize_rows_fp8_torch
from moebench.kernels.fused_experts_fp8_ref import BF16_REL
from moebench.peers import torch_grouped
from moebench.peers._lib import Library
from moebench.peers.compile import compile_available
from moebench.registry import register_impl

__all__ = ["DEEP_GEMM", "contiguous_layout", "mn_major", "sfa_is_mn_major", "swiglu_block_fp8", "DeepGemmExperts",
           "build_deepgemm"]

NEEDS = "m_grouped_fp8_gemm_nt_contiguous"


def _load():
    import deep_gemm

    return SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=deep_gemm.m_grouped_fp8_gemm_nt_contiguous,
                           get_mk_alignment_for_contiguous_layout=deep_gemm.get_mk_alignment_for_contiguous_layout)


DEEP_GEMM = Library("deep_gemm", "deep_gemm", _load, vendored=("vllm.third_party.deep_gemm",))


def capacity(num_routes: int, num_experts: int, align: int) -> int:
    """Rows of the contiguous layout for any routing of num_routes routes."""
    return -(-(num_routes + num_experts * (align - 1)) // align) * align


def contiguous_layout(topk_ids: torch.Tensor, num_experts: int, align: int, rows: int, *per_token: torch.Tensor):
    """topk_ids [M, K] -> (m_indices int32 [rows], position int64 [M*K]: each route's row, rows - 1 for skipped
    routes (never read: the combine selects them away), then each per_token tensor laid out [rows, ...])."""
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts).long()
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + align - 1) // align * align
    segment = torch.cumsum(padded, 0) - padded  # each expert's first row
    group = torch.cumsum(counts, 0) - counts  # each expert's first sorted route
    expert = sorted_key.clamp_max(num_experts - 1)
    rank = torch.arange(flat.numel(), device=flat.device) - group[expert]
    dump = rows  # one row past the layout: where the skipped routes' scatters land, then cut off
    pos_sorted = torch.where(sorted_key < num_experts, segment[expert] + rank, dump)
    position = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    m_indices = torch.full((rows + 1,), -1, dtype=torch.int32, device=flat.device)
    m_indices = m_indices.scatter(0, pos_sorted, torch.where(sorted_key < num_experts, sorted_key, -1).to(torch.int32))
    token = torch.zeros(rows + 1, dtype=torch.int64, device=flat.device)
    token = token.scatter(0, pos_sorted, order // topk_ids.shape[1])[:rows]
    return (m_indices[:rows], position.clamp_max(rows - 1), *(t.index_select(0, token) for t in per_token))


def mn_major(scales: torch.Tensor) -> torch.Tensor:
    """fp32 [R, G] -> the same values MN-major (stride 1 along R, R between columns): DeepGEMM's TMA-aligned
    transposed sfa layout when R is a multiple of 4 (the layout's rows are a multiple of the alignment). The strides
    are set explicitly: DeepGEMM compares both, also the one of a single column, which torch would make 1."""
    rows, cols = scales.shape
    return torch.as_strided(scales.t().contiguous(), (rows, cols), (1, rows))


def contiguous_layout_mn(topk_ids, num_experts, align, rows, x_q, x_sf):
    """contiguous_layout of the staged rows and their scales, the scales MN-major (mn_major)."""
    m_indices, position, laid, laid_sf = contiguous_layout(topk_ids, num_experts, align, rows, x_q, x_sf)
    return m_indices, position, laid, mn_major(laid_sf)


def swiglu_block_fp8(h: torch.Tensor, inter: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, 2I] -> silu(gate) * up in fp32, re-quantised per row per `group` columns (the staging's recipe):
    (e4m3 [R, I], fp32 [R, I/group] MN-major, see mn_major)."""
    q, s = requantize_rows_fp8_torch(torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float(), group)
    return q, mn_major(s)


def sfa_is_mn_major(sf: torch.Tensor) -> bool:
    """Whether DeepGEMM takes `sf` [M, K/128] as it is (csrc/jit_kernels/impls/smxx_layout.hpp): stride 1 along M
    and align(M, 4) between columns, else it transposes it inside the call."""
    return sf.stride(0) == 1 and sf.stride(1) == -(-sf.shape[0] // 4) * 4


class DeepGemmExperts:
    """fn(topk_ids, topk_weights, *, out) -> out on the staged rows and block weights it holds."""

    def __init__(self, lib, inp: Fp8Inputs):
        torch._dynamo.reset()  # a fresh compile per build (peers.torch_grouped)
        self.lib = lib
        self.layout = torch_grouped.compiled(contiguous_layout_mn)
        self.swiglu = torch_grouped.compiled(swiglu_block_fp8)
        self.combine = torch_grouped.compiled(torch_grouped.combine)
        self.inp = inp
        E, two_i, H = inp.w13_q.shape
        M, K = inp.ids.shape
        self.align = int(lib.get_mk_alignment_for_contiguous_layout())
        self.rows = capacity(M * K, E, self.align)
        dev = inp.x_q.device
        self.h = torch.empty(self.rows, two_i, dtype=torch.bfloat16, device=dev)  # outputs made once: no allocation
        self.y = torch.empty(self.rows, H, dtype=torch.bfloat16, device=dev)  # in a timed call
        self.info = {"deepgemm_rows": self.rows, "deepgemm_align": self.align,
                     "adapter_status": DEEP_GEMM.status()}

    def __call__(self, topk_ids, topk_weights, *, out):
        inp = self.inp
        E, two_i, _ = inp.w13_q.shape
        m_indices, position, rows, row_scales = self.layout(topk_ids, E, self.align, self.rows,
                                                            inp.x_q.view(torch.uint8), inp.x_sf)
        self.lib.m_grouped_fp8_gemm_nt_contiguous((rows.view(E4M3), row_scales), (inp.w13_q, inp.w13_s), self.h,
                                                  m_indices, disable_ue8m0_cast=True)
        a_q, a_scales = self.swiglu(self.h, two_i // 2, ACT_GROUP)
        if "deepgemm_sfa_layout" not in self.info:  # the first, untimed call (the compiled glue's strides)
            self.info["deepgemm_sfa_layout"] = (
                "MN-major TMA-aligned from the glue: no transpose inside the call"
                if sfa_is_mn_major(row_scales) and sfa_is_mn_major(a_scales) else
                "not MN-major: DeepGEMM transposes sfa inside each call (timed)")
        self.lib.m_grouped_fp8_gemm_nt_contiguous((a_q, a_scales), (inp.w2_q, inp.w2_s), self.y, m_indices,
                                                  disable_ue8m0_cast=True)
        return self.combine(self.y, position, topk_ids, topk_weights, E, out)


def build_deepgemm():
    made: dict = {}

    def make(p, inp: Fp8Inputs):
        fn = made["fn"] = DeepGemmExperts(DEEP_GEMM.get(), inp)
        operands = Fp8Operands(dequantize_staged(inp.x_q, inp.x_sf, inp.group_size, inp.scale_format),
                               lambda e: dequantize_weights(inp.w13_q[e], inp.w13_s[e]),
                               lambda e: dequantize_weights(inp.w2_q[e], inp.w2_s[e]), act_group=ACT_GROUP,
                               h_store_rel=BF16_REL)
        return fn, operands

    outside = build_fp8_outside(make)

    def build(p, ctx):
        case = outside(p, ctx)
        torch_grouped.warm(case, made.pop("fn"), ctx)
        return case
    return build


def sm90_only(ctx) -> str | None:
    """DeepGEMM takes fp32 1x128 / 128x128 scales on sm90 only (sm100 wants UE8M0); None on the stand-in."""
    lib = DEEP_GEMM.get()
    if ctx.is_cuda and not getattr(lib, "MOEBENCH_STANDIN", False):
        major = torch.cuda.get_device_capability(ctx.device)[0]
        if major != 9:
            return (f"DeepGEMM's fp32-scale recipe is the sm90 path; this GPU is sm{major}0 (UE8M0 scales, which "
                    "moebench's fp32 staging is not)")
    return None


def _problem(p) -> str | None:
    if p.group_size != 128 or p.scale_format != "fp32":
        return "group_size/scale_format: DeepGEMM's sm90 GEMM takes 1x128 fp32 activation scales (128, fp32)"
    return fp8_layout_problem(p)


register_impl("fused_experts.fp8_deepgemm", targets=("kernel",), validate=_problem, library=DEEP_GEMM.name,
              available=lambda ctx: DEEP_GEMM.available(ctx, NEEDS) or sm90_only(ctx) or compile_available(ctx),
              description="DeepGEMM m_grouped_fp8_gemm_nt_contiguous (1x128 / 128x128 block scales, sm90) on the "
                          "staged rows, compiled contiguous layout with MN-major scales + SwiGLU/requant + combine, "
                          "glue without host sync"
              )(build_deepgemm())
