"""DeepGEMM's grouped contiguous fp8 GEMM as an experts peer (library "deep_gemm"), DeepSeek-style block scales:

  fused_experts.fp8_deepgemm  deep_gemm.m_grouped_fp8_gemm_nt_contiguous for both GEMMs, on the staged rows as they
                              are (group 128, fp32 scales: DeepGEMM's 1x128 activation layout on sm90) and moebench's
                              128x128 block weights (its weight layout); the layout, the SwiGLU with its 1x128
                              re-quantisation and the combine through torch.compile, as the torch peers
                              (peers.torch_grouped). The glue has no host sync (the capacity is static); whether the
                              library call has none is unverified (the @gpu test of tests/test_peers_deepgemm.py).

The contiguous layout (compiled, `contiguous_layout`): each expert's routes padded up to a multiple of the alignment
(128), the experts one after the other, capacity ceil((T*K + E*127) / 128) * 128 rows; `m_indices` names each row's
expert, -1 for padding and the tail. Skipped routes (-1, non-local) get no row at all.

The call (DeepGEMM 2.8.0): m_grouped_fp8_gemm_nt_contiguous((a e4m3 [M, K], a_sf fp32 [M, K/128]), (b e4m3
[E, N, K], b_sf fp32 [E, N/128, K/128]), d bf16 [M, N], m_indices int32 [M], disable_ue8m0_cast=...): row m of d
is a[m] times group m_indices[m]'s weights; the d rows of padding (-1) are undefined; each group's segment is
aligned to get_mk_alignment_for_contiguous_layout() (128). UE8M0 scales are the sm100 path, so on sm90
disable_ue8m0_cast=True and the scales stay fp32.

Not run against a real DeepGEMM by moebench's tests: they use tests/standins/deep_gemm_standin.py, a stand-in with
this call's signature and layout rules. DeepGEMM is not installable from the package index here; on the GPU
machine it must be built from its repository (not committed, like DeepEP).
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

__all__ = ["DEEP_GEMM", "contiguous_layout", "swiglu_block_fp8", "DeepGemmExperts", "build_deepgemm"]

NEEDS = "m_grouped_fp8_gemm_nt_contiguous"


def _load():
    import deep_gemm

    return SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=deep_gemm.m_grouped_fp8_gemm_nt_contiguous,
                           get_mk_alignment_for_contiguous_layout=deep_gemm.get_mk_alignment_for_contiguous_layout)


DEEP_GEMM = Library("deep_gemm", "deep_gemm", _load)


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


def swiglu_block_fp8(h: torch.Tensor, inter: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, 2I] -> silu(gate) * up in fp32, re-quantised per row per `group` columns (the staging's recipe):
    (e4m3 [R, I], fp32 [R, I/group])."""
    return requantize_rows_fp8_torch(torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float(), group)


class DeepGemmExperts:
    """fn(topk_ids, topk_weights, *, out) -> out on the staged rows and block weights it holds."""

    def __init__(self, lib, inp: Fp8Inputs):
        torch._dynamo.reset()  # a fresh compile per build (peers.torch_grouped)
        self.lib = lib
        self.layout = torch_grouped.compiled(contiguous_layout)
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
        self.info = {"deepgemm_rows": self.rows, "deepgemm_align": self.align}

    def __call__(self, topk_ids, topk_weights, *, out):
        inp = self.inp
        E, two_i, _ = inp.w13_q.shape
        m_indices, position, rows, row_scales = self.layout(topk_ids, E, self.align, self.rows,
                                                            inp.x_q.view(torch.uint8), inp.x_sf)
        self.lib.m_grouped_fp8_gemm_nt_contiguous((rows.view(E4M3), row_scales), (inp.w13_q, inp.w13_s), self.h,
                                                  m_indices, disable_ue8m0_cast=True)
        a_q, a_scales = self.swiglu(self.h, two_i // 2, ACT_GROUP)
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


def _problem(p) -> str | None:
    if p.group_size != 128 or p.scale_format != "fp32":
        return "group_size/scale_format: DeepGEMM's sm90 GEMM takes 1x128 fp32 activation scales (128, fp32)"
    return fp8_layout_problem(p)


register_impl("fused_experts.fp8_deepgemm", targets=("kernel",), validate=_problem, library=DEEP_GEMM.name,
              available=lambda ctx: DEEP_GEMM.available(ctx, NEEDS) or compile_available(ctx),
              description="DeepGEMM m_grouped_fp8_gemm_nt_contiguous (1x128 / 128x128 block scales) on the staged "
                          "rows, compiled contiguous layout + SwiGLU/requant + combine, glue without host sync (the library call: unverified)"
              )(build_deepgemm())
