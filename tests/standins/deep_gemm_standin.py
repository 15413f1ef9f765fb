"""Stand-in for DeepGEMM's `deep_gemm.m_grouped_fp8_gemm_nt_contiguous` on sm90 (fp32 1x128 activation scales,
128x128 weight block scales), as read at deepseek-ai/DeepGEMM v2.6.1 (54e2261): csrc/apis/gemm.hpp (the call and
its keyword defaults), csrc/apis/layout.hpp and csrc/utils/layout.hpp (the scale checks), smxx_layout.hpp
(get_mn_major_tma_aligned_tensor), scheduler/gemm.cuh (rows of group -1). What it copies:
- a K-major e4m3 [M, K], b e4m3 [G, N, K], d bf16 [M, N] row-major, grouped_layout int32 [M], contiguous;
- sfb fp32 [G, N/128, K/128], contiguous or contiguous after swapping its last two dimensions;
- sfa fp32 [M, K/128]: taken as it is when MN-major and TMA-aligned (stride 1 along M, align(M, 4) between
  columns); any other layout is transposed inside the call (counted in `SFA_TRANSPOSES`, a JIT kernel on the GPU);
- each alignment block belongs to one group or is padding (-1); rows of -1 are left undefined (NaN here, so a
  caller that reads them fails its check); disable_ue8m0_cast is accepted and, on sm90 with fp32 scales, changes
  nothing."""

import torch

MOEBENCH_STANDIN = "deep_gemm"  # the moebench.peers Library it stands in for
BLOCK = 128
SFA_TRANSPOSES = [0]  # sfa layouts the library had to transpose itself (the transpose kernel's launches)


def get_mk_alignment_for_contiguous_layout():
    return BLOCK


def _tma_aligned(mn: int) -> int:
    return -(-mn // 4) * 4  # get_tma_aligned_size(mn, 4 bytes): 16-byte aligned


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True, expected_m_for_psum_layout=None):
    a_q, a_sf = a
    b_q, b_sf = b
    m, k = a_q.shape
    num_groups, n, _ = b_q.shape
    if use_psum_layout or recipe not in (None, (1, 128, 128)) or recipe_a is not None or recipe_b is not None:
        raise NotImplementedError("stand-in: the default sm90 recipe (1, 128, 128) with an m-indices layout only")
    if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn or d.dtype != torch.bfloat16:
        raise TypeError("m_grouped_fp8_gemm_nt_contiguous: e4m3 operands, bf16 output")
    if a_q.stride(-1) != 1 or b_q.stride(-1) != 1 or d.stride(-1) != 1:
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: sm90 takes K-major a and b and an N-major d")
    if tuple(d.shape) != (m, n) or tuple(grouped_layout.shape) != (m,) or grouped_layout.dtype != torch.int32:
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: shapes")
    if not grouped_layout.is_contiguous():
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: grouped_layout must be contiguous")
    if a_sf.dtype != torch.float32 or b_sf.dtype != torch.float32:
        raise TypeError("m_grouped_fp8_gemm_nt_contiguous: sm90 takes fp32 scales")
    if tuple(a_sf.shape) != (m, -(-k // BLOCK)) or tuple(b_sf.shape) != (num_groups, -(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: scale shapes")
    g, rn, rk = b_sf.shape
    if not (b_sf.stride() == (rn * rk, rk, 1) or b_sf.stride() == (rn * rk, 1, rn)):
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: sfb must be contiguous (or its last two dims swapped)")
    if not (a_sf.stride(0) == 1 and a_sf.stride(1) == _tma_aligned(m)):
        SFA_TRANSPOSES[0] += 1  # get_mn_major_tma_aligned_tensor copies it into that layout
    if m % BLOCK:
        raise ValueError("stand-in: M a multiple of the alignment (the layout's segments are)")
    blocks = grouped_layout.view(-1, BLOCK)
    first = blocks[:, :1]
    if bool(((blocks != first) & (blocks != -1)).any()) or bool(((first == -1) & (blocks != -1)).any()):
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: an alignment block holds rows of two groups")
    if bool((grouped_layout >= num_groups).any()) or bool((grouped_layout < -1).any()):
        raise IndexError("m_grouped_fp8_gemm_nt_contiguous: a group id past the weights (read out of bounds)")
    x = a_q.float() * a_sf.float().repeat_interleave(BLOCK, dim=1)[:, :k]
    d.fill_(float("nan"))
    for grp in torch.unique(grouped_layout[grouped_layout >= 0]).tolist():
        rows = (grouped_layout == grp).nonzero().flatten()
        w = b_q[grp].float() * b_sf[grp].float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        d[rows] = (x[rows] @ w.T).to(torch.bfloat16)
