"""moe_align_block_size: Triton kernels vs the torch reference vs a literal per-expert loop (docs/contracts.md)."""

import dataclasses
import functools

import pytest
import torch

from moebench.check import poison
from moebench.kernels._details.jit import next_pow2
from moebench.kernels.moe_align_block_size import (ALIGN_CANDIDATES, align_launch_shapes,
                                                   align_workspace, alloc_align_outputs, moe_align_block_size,
                                                   moe_align_block_size_torch)


OUT_NAMES = ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")


def literal_align(topk_ids, num_experts, block_size, expert_map=None, wrap_negative=False):
    """docs/contracts.md#align read word for word, one route and one expert at a time (slow, tiny inputs only)."""
    flat = [int(v) for v in topk_ids.reshape(-1).tolist()]
    num_routes = len(flat)
    index_range = expert_map.numel() if expert_map is not None else num_experts
    local = []
    for v in flat:
        if wrap_negative and -index_range <= v < 0:
            v += index_range
        if expert_map is not None:
            v = int(expert_map[v]) if 0 <= v < index_range else -1
        local.append(v if 0 <= v < num_experts else -1)
    capacity = num_routes + num_experts * (block_size - 1)
    sorted_ids = [num_routes] * capacity
    expert_ids = [-1] * -(-capacity // block_size)
    pos = 0
    for e in range(num_experts):
        routes = [i for i in range(num_routes) if local[i] == e]
        sorted_ids[pos:pos + len(routes)] = routes
        padded = -(-len(routes) // block_size) * block_size
        for b in range(pos // block_size, (pos + padded) // block_size):
            expert_ids[b] = e
        pos += padded
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(expert_ids, dtype=torch.int32),
            torch.tensor([pos], dtype=torch.int32))


def random_ids(num_tokens, top_k, id_range, *, generator, dtype=torch.int32, padded_rows=0, garbage=True):
    """Ids drawn from id_range, plus -1, out-of-range and negative garbage, and fully padded trailing rows."""
    ids = torch.randint(0, id_range, (num_tokens, top_k), generator=generator).to(dtype)
    if garbage and ids.numel():
        junk = torch.rand(ids.shape, generator=generator)
        ids[junk < 0.10] = -1
        ids[(junk >= 0.10) & (junk < 0.14)] = id_range  # first out-of-range id
        ids[(junk >= 0.14) & (junk < 0.16)] = id_range + 37
        ids[(junk >= 0.16) & (junk < 0.18)] = -5
    if padded_rows:
        ids[num_tokens - padded_rows:] = -1
    return ids


def run_triton_poisoned(topk_ids, num_experts, block_size, expert_map=None, **kw):
    """Launch into poisoned outputs and workspace, so an unwritten element or an uninitialised read shows."""
    block_routes = kw.get("block_routes")
    out = alloc_align_outputs(topk_ids.numel(), num_experts, block_size, topk_ids.device)
    ws = align_workspace(topk_ids.numel(), num_experts, topk_ids.device, block_routes=block_routes,
                         config=kw.get("config"))
    for t in (*out, ws):
        poison(t)
    return moe_align_block_size(topk_ids, num_experts, block_size, expert_map, out=out, workspace=ws, **kw)


def assert_same(got, want):
    for name, g, w in zip(OUT_NAMES, got, want):
        assert g.dtype == torch.int32, name
        assert g.shape == w.shape, (name, g.shape, w.shape)
        diff = (g.cpu() != w.cpu()).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} differ, first at {diff[:5].flatten().tolist()}"


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("num_experts", [4, 16, 64])
@pytest.mark.parametrize("block_size", [16, 64])
def test_align_matches_reference(top_k, num_experts, block_size, device):
    g = torch.Generator().manual_seed(1000 * top_k + 10 * num_experts + block_size)
    num_tokens = 9 + 2 * top_k  # M*K never a multiple of the kernel's block of routes
    ids = random_ids(num_tokens, top_k, num_experts, generator=g, padded_rows=5).to(device)
    want = moe_align_block_size_torch(ids, num_experts, block_size)
    assert_same(want, literal_align(ids.cpu(), num_experts, block_size))
    # A few blocks of routes (the interpreter's sort is slow, so inputs stay small).
    few_blocks = max(32, next_pow2(ids.numel() // 3))
    assert_same(run_triton_poisoned(ids, num_experts, block_size, block_routes=few_blocks), want)


def test_align_default_block_routes(device):
    g = torch.Generator().manual_seed(2)
    ids = random_ids(70, 8, 32, generator=g, padded_rows=9).to(device)  # 560 routes: 5 default blocks of 128
    assert_same(run_triton_poisoned(ids, 32, 16), literal_align(ids.cpu(), 32, 16))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_align_expert_map_skips_non_local(ids_dtype, device):
    g = torch.Generator().manual_seed(7)
    num_global, num_local, block_size = 24, 8, 16
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    owners = torch.randperm(num_global, generator=g)[:num_local]  # scattered local experts, shuffled local ids
    expert_map[owners] = torch.randperm(num_local, generator=g).to(torch.int32)
    expert_map[owners[0]] = num_local + 3  # a corrupt map entry: out of the local range, must be skipped
    ids = random_ids(50, 6, num_global, generator=g, dtype=ids_dtype, padded_rows=4)
    if ids_dtype == torch.int64:
        ids[0, 0] = 2**33 + 2  # would alias expert 2 if truncated to int32 before the range check
        ids[0, 1] = -(2**33)
    ids, expert_map = ids.to(device), expert_map.to(device)
    want = moe_align_block_size_torch(ids, num_local, block_size, expert_map)
    assert_same(want, literal_align(ids.cpu(), num_local, block_size, expert_map.cpu()))
    assert_same(run_triton_poisoned(ids, num_local, block_size, expert_map, block_routes=64), want)


def test_align_int64_ids_out_of_int32_range(device):
    ids = torch.tensor([[2**32 + 1, 1], [-(2**32) + 2, 3], [2, 2**31]], dtype=torch.int64, device=device)
    want = literal_align(ids.cpu(), 4, 16)
    assert want[2].item() == 48  # experts 1, 2, 3 each one block; the huge ids are skipped
    assert_same(run_triton_poisoned(ids, 4, 16), want)


def test_align_all_skipped(device):
    ids = torch.full((20, 6), -1, dtype=torch.int32, device=device)
    ids[3, 2] = 99  # out of range
    out = run_triton_poisoned(ids, 16, 16, block_routes=32)
    assert out[2].item() == 0
    assert (out[0] == 120).all() and out[0].numel() == 120 + 16 * 15
    assert (out[1] == -1).all()
    assert_same(out, moe_align_block_size_torch(ids, 16, 16))


def test_align_empty_input(device):
    ids = torch.empty(0, 8, dtype=torch.int32, device=device)
    out = moe_align_block_size(ids, 4, 16)
    assert_same(out, literal_align(ids.cpu(), 4, 16))


def test_align_block_size_one_and_odd(device):
    g = torch.Generator().manual_seed(3)
    ids = random_ids(30, 3, 8, generator=g).to(device)
    for block_size in (1, 5):
        want = literal_align(ids.cpu(), 8, block_size)
        assert_same(moe_align_block_size_torch(ids, 8, block_size), want)
        assert_same(run_triton_poisoned(ids, 8, block_size, block_routes=32), want)


def test_align_hot_expert_stable_order(device):
    # Every route on one expert (what unmasked identical padded rows do): order must be the flat index order.
    ids = torch.full((40, 6), 2, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, total = run_triton_poisoned(ids, 4, 16, block_routes=64)
    assert total.item() == 240
    assert torch.equal(sorted_ids[:240].cpu(), torch.arange(240, dtype=torch.int32))
    assert (expert_ids[:15] == 2).all() and (expert_ids[15:] == -1).all()


def test_align_small_tiles_loop_everywhere(device, monkeypatch):
    """Tiny tiles so every kernel loop runs several times: the scan over blocks (4 tiles), several expert chunks
    (the last one partial), the expert_ids slices, the pad fill; plus extra scatter programs that only write
    expert_ids."""
    import sys

    mod = sys.modules[moe_align_block_size.__module__]  # the package re-exports a function of the same name
    real = mod.align_launch_shapes

    def small(num_routes, num_experts, block_size, block_routes, config="first"):
        s = real(num_routes, num_experts, block_size, block_routes, config)
        s.update(experts_chunk=4, scan_grid=-(-num_experts // 4), tile_blocks=2, tile_m_blocks=2,
                 fill_block=16, scatter_grid=s["num_blocks"] + 3)
        s["m_blocks_per_program"] = -(-s["num_m_blocks"] // s["scatter_grid"])
        return s

    monkeypatch.setattr(mod, "align_launch_shapes", small)
    g = torch.Generator().manual_seed(23)
    num_experts = 10  # not a multiple of the chunk of 4
    ids = random_ids(33, 6, num_experts, generator=g, padded_rows=4).to(device)  # 198 routes: 7 blocks of 32
    want = literal_align(ids.cpu(), num_experts, 8)
    assert_same(run_triton_poisoned(ids, num_experts, 8, block_routes=32), want)
    expert_map = torch.randperm(14, generator=g).to(torch.int32) - 4  # ids 0..13, four of them non-local (-1..-4)
    expert_map = torch.where(expert_map < 0, -1, expert_map).to(device)
    ids14 = random_ids(33, 6, 14, generator=g).to(device)
    assert_same(run_triton_poisoned(ids14, num_experts, 8, expert_map, block_routes=32),
                literal_align(ids14.cpu(), num_experts, 8, expert_map.cpu()))


def test_align_deterministic(device):
    g = torch.Generator().manual_seed(11)
    ids = random_ids(40, 6, 16, generator=g).to(device)
    a = run_triton_poisoned(ids, 16, 16, block_routes=64)
    b = run_triton_poisoned(ids, 16, 16, block_routes=128)  # another split into blocks, same result
    assert_same(a, b)


def test_align_oblivious_wraps_minus_one(device):
    g = torch.Generator().manual_seed(5)
    num_experts = 16
    ids = random_ids(24, 6, num_experts, generator=g, padded_rows=6).to(device)
    want = literal_align(ids.cpu(), num_experts, 16, wrap_negative=True)
    assert_same(moe_align_block_size_torch(ids, num_experts, 16, wrap_negative=True), want)
    got = run_triton_poisoned(ids, num_experts, 16, block_routes=32, wrap_negative=True)
    assert_same(got, want)
    # The padded rows' routes (-1) now sit on the last expert: its segment holds the 36 padded routes.
    masked = literal_align(ids.cpu(), num_experts, 16)
    assert got[2].item() > masked[2].item()
    last = got[0][(got[1].repeat_interleave(16)[:got[0].numel()] == num_experts - 1).cpu()]
    padded_routes = set(range(18 * 6, 24 * 6))
    assert padded_routes <= set(last.tolist())


def test_align_rejects_bad_inputs(device):
    with pytest.raises(TypeError):
        moe_align_block_size(torch.zeros(2, 2, device=device), 4, 16)
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32, device=device), 4, 16, block_routes=24)


def small_tiled(cfg):
    """The config with tiles so small that every loop of its launches runs several times: scan groups of 3 block
    rows in tiles of 2, chunks of 4 experts, expert_ids tiles of a few blocks."""
    return dataclasses.replace(cfg, name=cfg.name + "_small", scan_group_rows=3, scan_experts_chunk=4,
                               scan_tile=8, expert_ids_tile=128)


# The kernel paths the candidates take (beside "default", which the tests above cover): grouped scan with the
# scatter reusing the raw counts, the same with tight bins, and tight bins with the 1-D scan (two histograms).
CONFIG_PATHS = {
    "grouped": small_tiled(ALIGN_CANDIDATES["grouped_scan"]),
    "tight_grouped": small_tiled(ALIGN_CANDIDATES["tight"]),
    "tight_serial": dataclasses.replace(ALIGN_CANDIDATES["first"], name="tight_serial", tight_bins=True),
}

# (num_tokens, top_k, ids drawn from, num_experts, block_size, with an expert map): 4..5 blocks of 32 routes
CANDIDATE_CASES = [
    (21, 6, 16, 16, 16, False),  # E a power of two: tight bins == E, skipped routes corrected out of bin 0
    (37, 4, 14, 10, 8, True),  # an expert map with non-local and corrupt entries, E not a power of two
    (17, 8, 32, 32, 64, False),  # block_size > routes per expert: mostly pad
    (43, 3, 8, 8, 5, False),  # odd block_size
]


def candidate_case(case, generator, device):
    num_tokens, top_k, id_range, num_experts, block_size, with_map = CANDIDATE_CASES[case]
    ids = random_ids(num_tokens, top_k, id_range, generator=generator, padded_rows=3).to(device)
    expert_map = None
    if with_map:
        expert_map = torch.full((id_range,), -1, dtype=torch.int32)
        owners = torch.randperm(id_range, generator=generator)[:num_experts]
        expert_map[owners] = torch.randperm(num_experts, generator=generator).to(torch.int32)
        expert_map[owners[0]] = num_experts + 1  # corrupt: outside the local range, skipped
        expert_map = expert_map.to(device)
    return ids, num_experts, block_size, expert_map


@pytest.mark.parametrize("path", list(CONFIG_PATHS))
@pytest.mark.parametrize("case", range(len(CANDIDATE_CASES)))
def test_align_config_paths_match_reference(path, case, device):
    """Every kernel path of the tuning candidates, over several blocks, gives the reference's outputs bit for bit."""
    ids, num_experts, block_size, expert_map = candidate_case(case, torch.Generator().manual_seed(31 * case + 5),
                                                              device)
    want = moe_align_block_size_torch(ids, num_experts, block_size, expert_map)
    assert_same(run_triton_poisoned(ids, num_experts, block_size, expert_map, block_routes=32,
                                    config=CONFIG_PATHS[path]), want)


@pytest.mark.parametrize("name", list(ALIGN_CANDIDATES))
def test_align_candidates_match_reference(name, device):
    """Each candidate by name, at its own block of routes, workspace sized for it."""
    ids, num_experts, block_size, expert_map = candidate_case(1, torch.Generator().manual_seed(len(name)), device)
    assert_same(run_triton_poisoned(ids, num_experts, block_size, expert_map, config=name),
                moe_align_block_size_torch(ids, num_experts, block_size, expert_map))


@pytest.mark.parametrize("name", [n for n in ALIGN_CANDIDATES if ALIGN_CANDIDATES[n].tight_bins])
def test_align_tight_bins_hot_expert_zero(name, device):
    """Tight bins count skipped routes in bin 0: with expert 0 hot and many skipped, its segment must hold exactly
    its own routes (the correction subtracts the skipped ones, lanes past the end included)."""
    ids = torch.zeros(30, 4, dtype=torch.int32)
    ids[::3] = -1
    ids[1, 2] = 16  # out of range
    ids[4, 1] = 3
    ids = ids.to(device)
    want = literal_align(ids.cpu(), 16, 16)
    assert want[2].item() == 80 + 16  # 78 routes of expert 0 (80 slots), one of expert 3
    assert_same(run_triton_poisoned(ids, 16, 16, block_routes=32, config=name), want)
    all_skipped = torch.full((9, 4), -1, dtype=torch.int32, device=device)
    assert_same(run_triton_poisoned(all_skipped, 16, 16, block_routes=32, config=name),
                literal_align(all_skipped.cpu(), 16, 16))


def test_align_config_by_name_and_default_launch(device):
    """A config named by the caller sizes the workspace and picks the launch alike; an unknown name is a one-line
    error naming the table; "first" keeps the first measured launch (one spare bin, 1-D scan over 32-expert
    chunks)."""
    g = torch.Generator().manual_seed(4)
    ids = random_ids(40, 6, 16, generator=g).to(device)
    want = moe_align_block_size_torch(ids, 16, 16)
    ws = align_workspace(ids.numel(), 16, ids.device, config="tight_br256")
    assert ws.numel() == 2 * 2 * 16 + 16  # 240 routes, 2 blocks of 128: counts and prefixes, then the totals
    assert_same(moe_align_block_size(ids, 16, 16, workspace=ws, config="tight_br256"), want)
    with pytest.raises(ValueError, match="'no_such_config' is not a moe_align_block_size config \\(one of first"):
        moe_align_block_size(ids, 16, 16, config="no_such_config")
    shapes = align_launch_shapes(524288, 256, 64, 1024, "first")
    assert (shapes["num_bins"], shapes["scan_grid"], shapes["scan_groups"], shapes["tile_blocks"],
            shapes["scatter_grid"], shapes["route_warps"]) == (512, 8, 1, 128, 2111, 4)
    tight = align_launch_shapes(524288, 256, 64, 256, "tight_br256")
    assert (tight["num_bins"], tight["scan_grid"], tight["scan_groups"], tight["route_warps"]) == (256, 32, 4, 1)


# GPU: every shape class under the default launch (tuned table or rule): T=1 (one block, fill-only programs), 64,
# 8192 and 65536 (buckets of the H200 table), E not a power of two (160, 384), E=1024 (the widest histogram) and
# 131072 x 8 at block 16 (1M routes: every candidate's scan loops over several tiles or row groups).
GPU_SHAPES = [(1, 8, 256, 64), (64, 8, 256, 64), (8192, 8, 256, 64), (65536, 8, 256, 64), (4096, 6, 160, 128),
              (131072, 8, 256, 16), (3000, 8, 384, 32), (777, 6, 1024, 64)]
# the oblivious wrap and the expert map (their own constexprs, HAS_MAP also a halved E) each at half of the shapes,
# each half holding T=1 or 64, a non-power-of-two E and a large T; the map also under candidates below
GPU_WRAP = {(1, 8, 256, 64), (8192, 8, 256, 64), (4096, 6, 160, 128), (777, 6, 1024, 64)}
GPU_MAP = {(64, 8, 256, 64), (65536, 8, 256, 64), (3000, 8, 384, 32), (131072, 8, 256, 16)}
# Candidates where they differ: at 1M routes each has its own routes per block (128..1024), warps and scan groups
# (with the expert map under the three kernel paths: 1-D scan, grouped scan, tight bins); at E=1024 (4662 routes,
# 128 per block for all) only bins and scan differ (first / grouped_scan 2048 bins, the tight ones 1024), both ways.
GPU_CANDIDATE_SHAPES = {(131072, 8, 256, 16): ("first", "grouped_scan", "tight"),
                        (777, 6, 1024, 64): tuple(ALIGN_CANDIDATES)}  # shape: the candidates also run with the map


@functools.lru_cache(maxsize=None)
def gpu_case(num_tokens, top_k, num_experts, block_size):
    """The ids of one GPU shape and their reference layouts (plain, expert map over the lower half), made once."""
    g = torch.Generator().manual_seed(num_tokens + top_k)
    ids = random_ids(num_tokens, top_k, num_experts, generator=g, padded_rows=num_tokens // 4).cuda()
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[: num_experts // 2] = torch.arange(num_experts // 2, dtype=torch.int32)
    expert_map = expert_map.cuda()
    return (ids, moe_align_block_size_torch(ids, num_experts, block_size), expert_map,
            moe_align_block_size_torch(ids, num_experts // 2, block_size, expert_map))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}_K{}_E{}_bs{}".format(*s))
def test_align_gpu_large_exact(shape):
    num_tokens, top_k, num_experts, block_size = shape
    ids, want, expert_map, want_map = gpu_case(*shape)
    assert_same(run_triton_poisoned(ids, num_experts, block_size), want)
    if shape in GPU_WRAP:
        assert_same(run_triton_poisoned(ids, num_experts, block_size, wrap_negative=True),
                    moe_align_block_size_torch(ids, num_experts, block_size, wrap_negative=True))
    if shape in GPU_MAP:
        assert_same(run_triton_poisoned(ids, num_experts // 2, block_size, expert_map), want_map)


@pytest.mark.gpu
def test_align_gpu_block_routes_splits():
    """Other splits into blocks (the GPU script sweeps them) at 24000 routes over 384 experts: 750 to 12 blocks,
    the last one partial, route programs of 1 to 8 warps (tl.histogram's GPU lowering depends on the CTA size)."""
    ids, want, _, _ = gpu_case(3000, 8, 384, 32)
    for block_routes in (32, 128, 512, 2048):
        assert_same(run_triton_poisoned(ids, 384, 32, block_routes=block_routes), want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_CANDIDATE_SHAPES), ids=lambda s: "T{}_K{}_E{}_bs{}".format(*s))
def test_align_gpu_candidates_exact(shape):
    """The tuning candidates, each at its own split, with and without an expert map."""
    num_tokens, top_k, num_experts, block_size = shape
    ids, want, expert_map, want_map = gpu_case(*shape)
    for name in ALIGN_CANDIDATES:
        assert_same(run_triton_poisoned(ids, num_experts, block_size, config=name), want)
        if name in GPU_CANDIDATE_SHAPES[shape]:
            assert_same(run_triton_poisoned(ids, num_experts // 2, block_size, expert_map, config=name), want_map)
