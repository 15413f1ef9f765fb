"""row_tile_map (the paired expert GEMMs' row tiles) against its reference, exactly, and the tiling's invariants."""

import pytest
import torch

from moebench.check import poison
from moebench.kernels import row_tiles
from moebench.kernels.moe_align_block_size import moe_align_block_size_torch
from moebench.kernels.row_tiles import row_tile_buffers, row_tile_map, row_tile_map_torch

CASES = [  # (tokens, top_k, experts, block_m, chunk): chunks of 16 make the scan cross chunk boundaries
    (40, 4, 8, 16, 1024), (300, 8, 16, 16, 1024), (7, 2, 4, 16, 1024), (500, 6, 32, 32, 1024), (1, 1, 1, 16, 1024),
    (900, 8, 4, 16, 16), (600, 8, 3, 16, 16), (64, 8, 64, 16, 16),
]


def _alignment(device, m, k, e, block_m, seed):
    g = torch.Generator().manual_seed(seed)
    # skewed: the first experts take most routes (long runs of blocks), -1 and ids >= E skipped
    ids = (torch.rand(m, k, generator=g) ** 3 * (e + 2)).long() - 1
    return moe_align_block_size_torch(ids.to(torch.int32).to(device), e, block_m)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tile_map_matches_reference(device, monkeypatch, case):
    m, k, e, block_m, chunk = CASES[case]
    monkeypatch.setattr(row_tiles, "_CHUNK", chunk)
    _, expert_ids, num_post = _alignment(device, m, k, e, block_m, seed=case)
    tile_map, num_tiles = (poison(t) for t in row_tile_buffers(expert_ids.numel(), device))
    row_tile_map(expert_ids, num_post, block_m, out=(tile_map, num_tiles))
    ref, count = row_tile_map_torch(expert_ids, num_post, block_m)
    assert num_tiles.tolist() == [count, 0, 0, 0, 0]  # the count, and both GEMMs' tile counters zeroed
    assert torch.equal(tile_map[:count].cpu(), ref)
    assert torch.equal(tile_map[count:].cpu(), poison(torch.empty_like(tile_map[count:])).cpu())  # never written


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tiles_cover_every_block_once_in_expert_order(device, case):
    """The reference's own invariants: each existing block in exactly one tile; a two-block tile's blocks have one
    owner; a one-block tile is its expert's last block, after the expert's full tiles, the expert's block count odd."""
    m, k, e, block_m, _ = CASES[case]
    _, expert_ids, num_post = _alignment(device, m, k, e, block_m, seed=case)
    owners = expert_ids[: int(num_post) // block_m].tolist()
    codes, _ = row_tile_map_torch(expert_ids, num_post, block_m)
    covered = []
    for code in codes.tolist():
        first, two = code >> 1, code & 1
        covered += [first, first + 1] if two else [first]
        if two:
            assert owners[first] == owners[first + 1]
        else:
            assert first + 1 == len(owners) or owners[first + 1] != owners[first]
            assert owners.count(owners[first]) % 2 == 1
    assert covered == list(range(len(owners)))


def test_needs_int32_buffers_of_the_block_capacity(device):
    expert_ids = torch.zeros(8, dtype=torch.int32, device=device)
    num_post = torch.tensor([16], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="tile_map"):
        row_tile_map(expert_ids, num_post, 16, out=row_tile_buffers(4, device))
    with pytest.raises(ValueError, match="num_tiles"):
        row_tile_map(expert_ids, num_post, 16,
                     out=(row_tile_buffers(8, device)[0], torch.zeros(1, dtype=torch.int32, device=device)))


def test_no_block_no_tile(device):
    """num_post_padded 0 (every route skipped): no tile, the counters zeroed, the map untouched."""
    expert_ids = torch.zeros(8, dtype=torch.int32, device=device)
    tile_map, num_tiles = (poison(t) for t in row_tile_buffers(8, device))
    row_tile_map(expert_ids, torch.zeros(1, dtype=torch.int32, device=device), 16, out=(tile_map, num_tiles))
    assert num_tiles.tolist() == [0, 0, 0, 0, 0]
    assert torch.equal(tile_map.cpu(), poison(torch.empty_like(tile_map)).cpu())


@pytest.mark.gpu
def test_tile_map_at_the_target_shape_gpu():
    """4096 tokens x top-8 over 128 experts, 64-row blocks (the paired launch's alignment) on the GPU, exactly."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    ids = torch.rand(4096, 128, generator=g, device=dev).topk(8, dim=1).indices.to(torch.int32)
    _, expert_ids, num_post = moe_align_block_size_torch(ids, 128, 64)
    tile_map, num_tiles = (poison(t) for t in row_tile_buffers(expert_ids.numel(), dev))
    row_tile_map(expert_ids, num_post, 64, out=(tile_map, num_tiles))
    ref, count = row_tile_map_torch(expert_ids, num_post, 64)
    assert num_tiles.tolist() == [count, 0, 0, 0, 0] and torch.equal(tile_map[:count].cpu(), ref)
