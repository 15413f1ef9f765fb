"""fused_experts: Triton path (align, gate/up+SwiGLU, down+weight, slot sum) against its torch references.

CPU runs go through Triton's interpreter, so shapes stay small (M=16, H=64, I=32, E=4)."""

import pytest
import torch

from moebench.check import poison
from moebench.kernels.grouped_gemm import (
    EXPERTS_CANDIDATES,
    ExpertsConfig,
    GemmConfig,
    align_routes,
    align_scratch_size,
    choose_config,
    sum_slots,
    sum_slots_torch,
    weight_operand,
)
from moebench.kernels.grouped_gemm_bf16 import down_proj, down_proj_torch, gate_up_swiglu, gate_up_swiglu_torch
from moebench.kernels.fused_experts import (
    fused_experts,
    fused_experts_torch,
    make_workspace,
)
from moebench.inputs import make_expert_weights
from moebench.kernels.moe_align_block_size import moe_align_block_size, moe_align_block_size_torch

M, H, I, E = 16, 64, 32, 4


def _frob(out, ref):
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _problem(device, K, *, seed=0, m=M, h=H, i=I, e=E, skip_frac=0.25, high_ids=True):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    w13, w2 = make_expert_weights(e, h, i, seed=seed, device="cpu")
    ids = torch.stack([torch.randperm(e + 2 if high_ids else e, generator=g)[:K] for _ in range(m)])
    ids = torch.where(ids >= e + 1, torch.full_like(ids, -1), ids) if high_ids else ids  # e -> ">= E" case
    ids = torch.where(torch.rand(m, K, generator=g) < skip_frac, torch.full_like(ids, -1), ids).to(torch.int32)
    w = torch.rand(m, K, generator=g) + 0.05
    return [t.to(device) for t in (x, w13, w2, w, ids)]


@pytest.mark.parametrize("K", [1, 2, 6])
def test_matches_fp32_reference(device, K):
    x, w13, w2, w, ids = _problem(device, K, seed=K)
    assert ((ids >= 0) & (ids < E)).sum() > 0 and (ids < 0).any()
    out = poison(torch.empty(M, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, out=out)
    ref = fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert _frob(out, ref) < 1e-2
    # the bf16 eager peer lands in the same place
    assert _frob(fused_experts_torch(x, w13, w2, w, ids, compute_dtype=torch.bfloat16), ref) < 1e-2


CONFIGS = [
    # BLOCK_M larger than most experts' routes; BLOCK_N > I (masked columns); odd swizzle group
    ExpertsConfig(32, GemmConfig(64, 32, 3, 4, 2), GemmConfig(128, 32, 1, 4, 2), reduce_block_h=32),
    # K not a multiple of BLOCK_K (H=80, I=48 below): the k-masked loads
    ExpertsConfig(16, GemmConfig(16, 32, 2, 4, 2), GemmConfig(32, 32, 2, 4, 2), reduce_block_h=64),
    # weights through TMA descriptors (I % BN == 0, H % BN == 0)
    ExpertsConfig(16, GemmConfig(16, 32, 8, 4, 2, weight_tma=True), GemmConfig(32, 32, 8, 4, 2, weight_tma=True)),
    # TMA with a K tail (H=80, I=48: the descriptor zero-fills past the row end)
    ExpertsConfig(16, GemmConfig(16, 32, 8, 4, 2, weight_tma=True), GemmConfig(16, 32, 8, 4, 2, weight_tma=True)),
    # TMA asked for where BLOCK_N does not divide I / H: falls back to pointer loads
    ExpertsConfig(16, GemmConfig(64, 32, 8, 4, 2, weight_tma=True), GemmConfig(128, 32, 8, 4, 2, weight_tma=True)),
    # both down operands through descriptors, a K tail (I=48) zero-filled in act's boxes; the tile and K loops
    # flattened into one pipeline
    ExpertsConfig(16, GemmConfig(16, 32, 8, 4, 2, weight_tma=True, flatten=True),
                  GemmConfig(16, 32, 8, 4, 2, weight_tma=True, act_tma=True, flatten=True)),
    # gate/up's A rows staged in sorted order and read through a descriptor too (stage_rows), a K tail (H=80)
    ExpertsConfig(16, GemmConfig(16, 32, 8, 4, 2, weight_tma=True, act_tma=True),
                  GemmConfig(16, 32, 8, 4, 2, weight_tma=True, act_tma=True, warp_specialize=True)),
    # gate and up rows in one [1, 2, BN, BK] box, one 2*BN-wide dot split after the loop; a K tail (H=80)
    ExpertsConfig(16, GemmConfig(16, 32, 8, 4, 2, weight_tma=True, one_dot=True),
                  GemmConfig(16, 32, 8, 4, 2, weight_tma=True)),
]


@pytest.mark.parametrize("cfg_i", range(len(CONFIGS)))
def test_other_configs(device, cfg_i):
    cfg = CONFIGS[cfg_i]
    h, i = (80, 48) if cfg_i in (1, 3, 5, 6, 7) else (H, I)
    x, w13, w2, w, ids = _problem(device, 3, seed=10 + cfg_i, h=h, i=i)
    want_tma = cfg_i in (2, 3, 5, 6, 7)
    assert weight_operand(w13, cfg.gate_up.block_n, cfg.gate_up, i)[1] == want_tma
    assert weight_operand(w2, cfg.down.block_n, cfg.down, h)[1] == want_tma
    out = poison(torch.empty(M, h, dtype=torch.bfloat16, device=device))
    ws = make_workspace(M, 3, E, h, i, config=cfg, device=device)
    assert (ws.x_rows is not None) == cfg.gate_up.act_tma
    fused_experts(x, w13, w2, w, ids, workspace=ws, out=out)
    ref = fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)
    assert _frob(out, ref) < 1e-2


PAIRED_CONFIGS = [
    # full tiles of 32 rows on 16-row blocks; BLOCK_N < I and > I; pointer and TMA weights
    ExpertsConfig(16, GemmConfig(16, 32, 2, 4, 2), GemmConfig(32, 32, 3, 4, 2), reduce_block_h=64, paired=True),
    ExpertsConfig(16, GemmConfig(64, 32, 8, 4, 2, weight_tma=True), GemmConfig(64, 32, 1, 4, 2, weight_tma=True),
                  paired=True),
]


@pytest.mark.parametrize("cfg_i", range(len(PAIRED_CONFIGS)))
def test_paired_tiles_match_one_block_tiles(device, cfg_i):
    """A paired launch (two alignment blocks a tile, an expert's odd last block alone) writes what the launch of one
    block a tile writes: act and y bitwise in the interpreter (fp32 dots, K in the same order), the same rows
    untouched; experts with odd and even block counts, an empty one, -1 and ids >= E."""
    import dataclasses

    from moebench.kernels.grouped_gemm import launch_tiles
    from moebench.kernels.row_tiles import row_tile_buffers

    paired = PAIRED_CONFIGS[cfg_i]
    single = dataclasses.replace(paired, paired=False)
    m, K, e = 48, 4, 6
    x, w13, w2, w, ids = _problem(device, K, seed=30 + cfg_i, m=m, e=e, skip_frac=0.15)
    ids = torch.where(ids == 3, 0, ids)  # expert 3 empty, expert 0 many blocks
    ws = make_workspace(m, K, e, H, I, config=paired, device=device)
    s, ex, n = align_routes(ids, e, 16, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch))
    blocks = torch.bincount(ex[: int(n) // 16].long().cpu(), minlength=e)
    assert (blocks % 2 == 1).any() and ((blocks % 2 == 0) & (blocks > 0)).any() and blocks[3] == 0
    tiles = launch_tiles(paired, ex, n, ws.tiles)
    assert launch_tiles(single, ex, n, row_tile_buffers(ex.numel(), device)) is None
    outs = []
    for cfg, t in ((paired, tiles), (single, None)):
        act, y = poison(torch.empty_like(ws.act)), poison(torch.empty_like(ws.y))
        gate_up_swiglu(x, w13, s, ex, n, K, 16, cfg.gate_up, act, t)
        down_proj(act, w2, w, s, ex, n, 16, cfg.down, y, t)
        outs.append((act, y))
    (act_p, y_p), (act_1, y_1) = outs
    # each launch's last program zeroed its tile counters: the same map launched again computes every tile again
    assert tiles[1][1:].tolist() == [0, 0, 0, 0]
    again = poison(torch.empty_like(ws.act))
    gate_up_swiglu(x, w13, s, ex, n, K, 16, paired.gate_up, again, tiles)
    assert torch.equal(torch.nan_to_num(again.float()), torch.nan_to_num(act_p.float()))
    exact = device.type == "cpu"
    for a, b in ((act_p, act_1), (y_p, y_1)):
        assert torch.equal(torch.isnan(a.float()).cpu(), torch.isnan(b.float()).cpu())  # same rows written
        same = torch.nan_to_num(a.float()) - torch.nan_to_num(b.float())
        assert (same == 0).all() if exact else _frob(torch.nan_to_num(a), torch.nan_to_num(b)) < 1e-3
    act_ref = gate_up_swiglu_torch(x, w13, s, ex, n, K, 16)
    assert _frob(act_p[: int(n)], act_ref) < 5e-3
    out = poison(torch.empty(m, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, workspace=ws, out=out)
    assert _frob(out, fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)) < 1e-2


def test_paired_with_fewer_routes_than_experts_and_an_outside_alignment(device):
    """R < E (decode on many experts: the alignment's block capacity exceeds the blocks routes can fill) and an
    alignment passed in, with buffers larger than it needs: the paired launch still matches the reference."""
    m, K, e = 3, 2, 16
    x, w13, w2, w, ids = _problem(device, K, seed=40, m=m, e=e, skip_frac=0.0, high_ids=False)
    ref = fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)
    out = poison(torch.empty(m, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, config=PAIRED_CONFIGS[0], out=out)
    assert _frob(out, ref) < 1e-2
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, e, 16)
    big_sorted = torch.full((4096,), m * K, dtype=torch.int32, device=device)
    big_experts = torch.full((512,), -5, dtype=torch.int32, device=device)
    big_sorted[: sorted_ids.numel()] = sorted_ids
    big_experts[: expert_ids.numel()] = expert_ids
    alignment = (big_sorted, big_experts, num_post)
    out2 = poison(torch.empty_like(out))
    fused_experts(x, w13, w2, w, ids, config=PAIRED_CONFIGS[0], out=out2, alignment=alignment)
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))


def test_paired_config_needs_a_paired_workspace(device):
    import dataclasses

    x, w13, w2, w, ids = _problem(device, 2, seed=2)
    single = make_workspace(M, 2, E, H, I, config=dataclasses.replace(PAIRED_CONFIGS[0], paired=False), device=device)
    assert single.tiles is None
    with pytest.raises(ValueError, match="paired"):
        fused_experts(x, w13, w2, w, ids, workspace=single, config=PAIRED_CONFIGS[0])
    with pytest.raises(ValueError, match="paired"):
        make_workspace(M, 2, E, 128, 128, config=dataclasses.replace(PAIRED_CONFIGS[0], precision="fp8_block"),
                       device=device, precision="fp8_block")


@pytest.mark.parametrize("K,num_experts,block_m,m", [(6, 4, 16, 16), (2, 5, 4, 9), (8, 3, 32, 40), (1, 7, 16, 3)])
def test_align_routes_exact(device, K, num_experts, block_m, m):
    g = torch.Generator().manual_seed(K * 100 + m)
    ids = torch.randint(-1, num_experts + 2, (m, K), generator=g, dtype=torch.int32).to(device)
    out = [poison(t) for t in (torch.empty(m * K + num_experts * (block_m - 1), dtype=torch.int32, device=device),
                               torch.empty(-(-(m * K + num_experts * (block_m - 1)) // block_m), dtype=torch.int32,
                                           device=device),
                               torch.empty(1, dtype=torch.int32, device=device),
                               torch.empty(align_scratch_size(m * K, num_experts), dtype=torch.int32,
                                           device=device))]
    got = align_routes(ids, num_experts, block_m, out=tuple(out))
    ref = moe_align_block_size_torch(ids, num_experts, block_m)
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_post_padded"), got, ref):
        assert torch.equal(a.cpu(), b.cpu()), name
    # int64 ids give the same answer
    got64 = align_routes(ids.long(), num_experts, block_m)
    for a, b in zip(got64, ref):
        assert torch.equal(a.cpu(), b.cpu())


def _gpu_choose_config(monkeypatch, *args):
    """choose_config as on a GPU (under the interpreter it returns CPU-sized tiles)."""
    import sys

    gg = sys.modules[choose_config.__module__]
    monkeypatch.setattr(gg, "interpreting", lambda: False)
    return choose_config(*args)


def test_choose_config_tiers(monkeypatch):
    # The issue-3 target shape: 256 routes per expert -> BM128, gate/up N128 K64 w8 s3 + TMA, down N256 K64 w8 s3 + TMA
    big = _gpu_choose_config(monkeypatch, 4096 * 8, 128, 7168, 2048)
    assert big == ExpertsConfig(128, GemmConfig(128, 64, 8, 8, 3, weight_tma=True),
                                GemmConfig(256, 64, 8, 8, 3, weight_tma=True), reduce_block_h=1024)
    assert big.short() == "BM128 up:N128K64w8s3g8tma down:N256K64w8s3g8tma"
    assert _gpu_choose_config(monkeypatch, 128 * 128, 128, 7168, 2048).block_m == 128  # 128 routes per expert
    mid = _gpu_choose_config(monkeypatch, 127 * 128, 128, 7168, 2048)
    assert mid.block_m == 64 and not mid.gate_up.weight_tma and not mid.down.weight_tma
    assert _gpu_choose_config(monkeypatch, 48 * 128, 128, 7168, 2048).block_m == 32
    assert _gpu_choose_config(monkeypatch, 8 * 128, 128, 7168, 2048).block_m == 16
    # Small hidden/intermediate sizes shrink the tiles but keep the TMA request (the launch checks the layout).
    small = _gpu_choose_config(monkeypatch, 32 * 8, 2, 64, 32)
    assert small.block_m == 128 and small.gate_up.weight_tma and small.down.weight_tma
    assert (small.gate_up.block_n, small.gate_up.block_k, small.down.block_n, small.down.block_k) == (32, 64, 64, 32)


def test_large_tier_config_runs(device, monkeypatch):
    """The BM128 + TMA tier's config (tiles shrunk to H=64, I=32) end to end in the interpreter / on a GPU."""
    K, m, e = 2, 128, 2  # 128 routes per expert
    cfg = _gpu_choose_config(monkeypatch, m * K, e, H, I)
    monkeypatch.undo()
    assert cfg.block_m == 128
    x, w13, w2, w, ids = _problem(device, K, seed=12, m=m, e=e, skip_frac=0.3, high_ids=False)
    ids[-5:] = -1  # padded rows
    assert weight_operand(w13, cfg.gate_up.block_n, cfg.gate_up, I)[1]
    assert weight_operand(w2, cfg.down.block_n, cfg.down, H)[1]
    out = poison(torch.empty(m, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, config=cfg, out=out)
    ref = fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)
    assert _frob(out, ref) < 1e-2
    assert (out[-5:] == 0).all()


@pytest.mark.parametrize("name", list(EXPERTS_CANDIDATES))
def test_candidates_match_reference(device, name):
    """Every candidate of the table, by name (fitted to H=64, I=32), against the fp32 reference; the workspace keeps
    the explicit choice, and with no name the rule's (no table on the CPU)."""
    K = 2
    x, w13, w2, w, ids = _problem(device, K, seed=5)
    ws = make_workspace(M, K, E, H, I, config=name, device=device)
    assert (ws.choice.name, ws.choice.source, ws.config.block_m) == (name, "explicit", EXPERTS_CANDIDATES[name].block_m)
    out = poison(torch.empty(M, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, workspace=ws, out=out)
    assert _frob(out, fused_experts_torch(x, w13, w2, w, ids, out_dtype=torch.float32)) < 1e-2
    if device.type == "cpu":
        assert make_workspace(M, K, E, H, I, device=device).choice.source == "rule"


def test_sub_kernels_vs_references(device):
    K = 6
    x, w13, w2, w, ids = _problem(device, K, seed=3)
    cfg = choose_config(M * K, E, H, I)
    ws = make_workspace(M, K, E, H, I, config=cfg, device=device)
    for t in (ws.act, ws.y, ws.align_scratch, ws.sorted_ids, ws.expert_ids, ws.num_post):
        poison(t)
    s, e, n = align_routes(ids, E, cfg.block_m, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch))
    num_post = int(n)
    gate_up_swiglu(x, w13, s, e, n, K, cfg.block_m, cfg.gate_up, ws.act)
    act_ref = gate_up_swiglu_torch(x, w13, s, e, n, K, cfg.block_m)
    assert _frob(ws.act[:num_post], act_ref) < 5e-3
    pad_rows = (s[:num_post] >= M * K)
    assert pad_rows.any() and (ws.act[:num_post][pad_rows] == 0).all()  # pad entries: zero rows
    assert torch.isnan(ws.act[num_post:].float()).all()  # blocks that do not exist: never written
    down_proj(ws.act, w2, w, s, e, n, cfg.block_m, cfg.down, ws.y)
    y_ref = down_proj_torch(ws.act[:num_post], w2, w, s, e, n, cfg.block_m)
    placed = ~torch.isnan(y_ref[:, 0])
    assert torch.equal(placed.cpu(), ((ids >= 0) & (ids < E)).reshape(-1).cpu())
    assert _frob(ws.y[placed], y_ref[placed]) < 5e-3
    assert torch.isnan(ws.y[~placed].float()).all()  # skipped routes: no GEMM output at all
    out = poison(torch.empty(M, H, dtype=torch.bfloat16, device=device))
    sum_slots(ws.y, ids, E, out, block_h=32)
    # same fp32 order, one rounding: bitwise
    assert torch.equal(out.cpu().view(torch.int16), sum_slots_torch(ws.y, ids, E, torch.bfloat16).cpu()
                       .view(torch.int16))


def test_precomputed_alignment(device):
    """An alignment from moe_align_block_size (docs/contracts.md#align) (the pipeline's own stage) gives the same result."""
    K = 6
    x, w13, w2, w, ids = _problem(device, K, seed=4)
    cfg = choose_config(M * K, E, H, I)
    own = fused_experts(x, w13, w2, w, ids, config=cfg)
    given = fused_experts(x, w13, w2, w, ids, config=cfg, alignment=moe_align_block_size(ids, E, cfg.block_m))
    assert torch.equal(own.cpu().view(torch.int16), given.cpu().view(torch.int16))
    with pytest.raises(ValueError, match="alignment"):
        small = align_routes(ids, E, cfg.block_m // 2)
        fused_experts(x, w13, w2, w, ids, config=cfg, alignment=small)


def test_padded_rows_nan_give_zeros(device):
    K = 4
    x, w13, w2, w, ids = _problem(device, K, seed=5, skip_frac=0.1)
    padded = torch.zeros(M, dtype=torch.bool, device=device)
    padded[-5:] = True
    ids[padded] = -1
    x[padded] = float("nan")  # a padded token's row: never read
    w = torch.where(ids < 0, torch.full_like(w, float("nan")), w)  # a skipped slot's weight: never read
    out = poison(torch.empty(M, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, out=out)
    assert (out[padded] == 0).all()
    real = ~padded
    assert torch.isfinite(out[real]).all()
    ref = fused_experts_torch(x[real], w13, w2, torch.nan_to_num(w[real]), ids[real], out_dtype=torch.float32)
    assert _frob(out[real], ref) < 1e-2


def test_ids_at_or_above_num_experts_are_skipped(device):
    K = 3
    x, w13, w2, w, ids = _problem(device, K, seed=6, high_ids=False, skip_frac=0.0)
    high = ids.clone()
    high[::3, 0] = E
    high[1::4, 1] = E + 7
    minus = torch.where(high >= E, torch.full_like(high, -1), high)
    a = fused_experts(x, w13, w2, w, high)
    b = fused_experts(x, w13, w2, w, minus)
    assert torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def test_all_skipped_and_empty(device):
    x, w13, w2, w, ids = _problem(device, 2, seed=7)
    ids.fill_(-1)
    x[:] = float("nan")
    out = poison(torch.empty(M, H, dtype=torch.bfloat16, device=device))
    fused_experts(x, w13, w2, w, ids, out=out)
    assert (out == 0).all()
    empty = fused_experts(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, H)


def test_oblivious_twin_differs(device):
    K = 4
    x, w13, w2, w, ids = _problem(device, K, seed=8, skip_frac=0.2, high_ids=False)
    x[-3:] = float("nan")  # padded tokens with garbage
    ids[-3:] = -1
    w[-3:] = 0.0
    wrapped = torch.where(ids < 0, torch.full_like(ids, E - 1), ids)  # expert_map[-1]: the last local expert
    masked = fused_experts(x, w13, w2, w, ids)
    oblivious = fused_experts(x, w13, w2, w, wrapped)
    assert (masked[-3:] == 0).all() and torch.isnan(oblivious[-3:].float()).all()
    real_with_skip = (ids[:-3] < 0).any(dim=1)
    assert real_with_skip.any()
    assert not torch.allclose(masked[:-3][real_with_skip].float(), oblivious[:-3][real_with_skip].float())
    # and the oblivious twin is right about what it computes
    ref = fused_experts_torch(x[:-3], w13, w2, w[:-3], wrapped[:-3], out_dtype=torch.float32)
    assert _frob(oblivious[:-3], ref) < 1e-2


def test_shape_errors(device):
    x, w13, w2, w, ids = _problem(device, 2, seed=1)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w13, w2, w[:, :1], ids)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "bm64x2_tma"])
@pytest.mark.parametrize("skip_frac", [0.0, 0.5])
def test_target_shape_gpu(skip_frac, config):
    """128 local experts, 4096 tokens x top-8, H=7168, I=2048 vs the fp32 reference on 256 sampled rows; the
    default launch and the paired one (whose output a CUDA graph's replay repeats bitwise)."""
    dev = torch.device("cuda")
    m, k, e, h, i = 4096, 8, 128, 7168, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    w13, w2 = make_expert_weights(e, h, i, seed=0, device=dev)
    ids = torch.rand(m, e, generator=g, device=dev).topk(k, dim=1).indices.to(torch.int32)
    ids = torch.where(torch.rand(m, k, generator=g, device=dev) < skip_frac, -1, ids).to(torch.int32)
    w = torch.softmax(torch.randn(m, k, generator=g, device=dev), dim=1)
    out = poison(torch.empty(m, h, dtype=torch.bfloat16, device=dev))
    ws = make_workspace(m, k, e, h, i, config=config, device=dev)
    fused_experts(x, w13, w2, w, ids, workspace=ws, out=out)
    assert torch.isfinite(out).all()
    if config is not None:
        replayed = poison(torch.empty_like(out))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_experts(x, w13, w2, w, ids, workspace=ws, out=replayed)
        poison(replayed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed.view(torch.int16), out.view(torch.int16))
    rows = torch.randperm(m, generator=torch.Generator().manual_seed(1))[:256].sort().values.to(dev)
    ref = fused_experts_torch(x[rows], w13, w2, w[rows], ids[rows], out_dtype=torch.float32)
    assert _frob(out[rows], ref) < 1e-2


def test_alignment_scratch_follows_the_align_config(tmp_path, monkeypatch):
    """align_scratch_size is moe_align_block_size's workspace under the config it chooses (here a tuned table's
    entry), so a candidate with a larger workspace (grouped scan: counts and prefixes) still fits the grouped GEMM's
    scratch."""
    import json

    from moebench.kernels._details import tuning
    from moebench.kernels.moe_align_block_size import align_workspace_size

    monkeypatch.setattr(tuning, "TABLES_DIR", tmp_path)
    tuning.clear_cache()
    first = align_workspace_size(4096, 64, config="first")
    table = {"format": 1, "gpu": "cpu", "kernels": {"moe_align_block_size": {"R=4096,E=64": {"config": "tight_br128"}}}}
    (tmp_path / "cpu.json").write_text(json.dumps(table))
    tuning.clear_cache()
    try:
        assert align_scratch_size(4096, 64, "cpu") == align_workspace_size(4096, 64, config="tight_br128") > first
    finally:
        tuning.clear_cache()
