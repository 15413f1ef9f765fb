"""Stand-in for DeepGEMM's `deep_gemm.m_grouped_fp8_gemm_nt_contiguous` (sm90 path: fp32 1x128 activation scales,
128x128 weight block scales), with its call signature and its contiguous layout: each 128-row block of `a` belongs
to one group (m_indices) or is padding (-1); rows of -1 are left undefined (NaN here, so a caller that reads them
fails its check)."""

import torch

MOEBENCH_STANDIN = "deep_gemm"  # the moebench.peers Library it stands in for
BLOCK = 128


def get_mk_alignment_for_contiguous_layout():
    return BLOCK


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices, disable_ue8m0_cast=False):
    a_q, a_sf = a
    b_q, b_sf = b
    m, k = a_q.shape
    num_groups, n, _ = b_q.shape
    if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn or d.dtype != torch.bfloat16:
        raise TypeError("m_grouped_fp8_gemm_nt_contiguous: e4m3 operands, bf16 output")
    if m % BLOCK or tuple(d.shape) != (m, n) or m_indices.shape != (m,) or m_indices.dtype != torch.int32:
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: shapes")
    if tuple(a_sf.shape) != (m, k // BLOCK) or tuple(b_sf.shape) != (num_groups, n // BLOCK, k // BLOCK):
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: scale shapes")
    blocks = m_indices.view(-1, BLOCK)
    first = blocks[:, :1]
    if bool(((blocks != first) & (blocks != -1)).any()) or bool(((first == -1) & (blocks != -1)).any()):
        raise ValueError("m_grouped_fp8_gemm_nt_contiguous: a 128-row block holds rows of two groups")
    x = a_q.float() * a_sf.float().repeat_interleave(BLOCK, dim=1)
    d.fill_(float("nan"))
    for g in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = (m_indices == g).nonzero().flatten()
        w = b_q[g].float() * b_sf[g].float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        d[rows] = (x[rows] @ w.T).to(torch.bfloat16)
