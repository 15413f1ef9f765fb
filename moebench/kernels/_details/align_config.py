"""Launch configurations of moe_align_block_size: the candidate table and the host arithmetic of its grids.

Every candidate gives bitwise the same outputs (the work split and the histogram formulation change, never the
order: the in-block sort key is (expert, position) under all of them). "first" is the plain launch (one histogram
bin to spare, 1024-route blocks, the 1-D scan), DEFAULT_ALIGN_CONFIG the rule where the tuned table has no entry
(the fastest on the H200); the others are candidates for `moebench tune sweeps/tune_align.yaml` (moe_align_block_size's
docstring says what each changes). Bucket of a launch: R=next_pow2(routes),E=experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from moebench.kernels._details.jit import next_pow2
from moebench.kernels._details.tuning import Choice, Tunable, choose, pow2_bucket, register_tunable

__all__ = ["AlignConfig", "ALIGN_CANDIDATES", "DEFAULT_ALIGN_CONFIG", "align_choice", "resolve_align_config",
           "default_block_routes", "align_workspace_size", "align_launch_shapes", "align_capacity"]

# The rule's launch: the fastest on the H200 at E=256, K=8 (docs/benchmarks.md#alignment-moe_align_block_size).
DEFAULT_ALIGN_CONFIG = "tight_br256_w2"


@dataclass(frozen=True)
class AlignConfig:
    name: str
    max_block_routes: int = 1024  # routes per program: next_pow2(routes / target_programs) in [128, this]
    target_programs: int = 256
    routes_per_warp: int = 256  # warps of the route programs: block_routes / this, 1..8
    # Histogram over next_pow2(E) bins (skipped routes counted in bin 0, then subtracted) instead of
    # next_pow2(E + 1) with a spare bin: half the bins when E is a power of two (tl.histogram's cost per route
    # grows with the bins each lane owns).
    tight_bins: bool = False
    # Scan into a second [blocks, E] buffer over a 2-D grid (expert chunks x groups of block rows, each group
    # first summing the rows before it), so the raw counts survive and the scatter reuses them instead of a
    # second histogram. Off: the 1-D in-place scan, one program per chunk looping over all rows.
    grouped_scan: bool = False
    scan_experts_chunk: int = 32
    scan_tile: int = 4096  # counts per scan tile
    scan_group_rows: int = 512  # block rows per scan program (grouped_scan only)
    expert_ids_tile: int = 2048  # (m-block, bin) compares per scatter program for expert_ids


ALIGN_CANDIDATES: dict[str, AlignConfig] = {c.name: c for c in (
    AlignConfig("first"),  # the plain launch: every other candidate is a change of it
    # the scan on 32x more programs (chunks of 8 experts, one tile of rows each) and expert_ids on 4x fewer
    AlignConfig("grouped_scan", grouped_scan=True, scan_experts_chunk=8, expert_ids_tile=8192),
    # ... plus tight bins and one histogram instead of two: the route-proportional work of count + scatter
    AlignConfig("tight", tight_bins=True, grouped_scan=True, scan_experts_chunk=8, expert_ids_tile=8192),
    # ... plus smaller in-block sorts (log^2 stages: 1024 -> 55, 512 -> 45, 256 -> 36, 128 -> 28), more counts rows
    AlignConfig("tight_br512", max_block_routes=512, tight_bins=True, grouped_scan=True, scan_experts_chunk=8,
                expert_ids_tile=8192),
    AlignConfig("tight_br256", max_block_routes=256, tight_bins=True, grouped_scan=True, scan_experts_chunk=8,
                expert_ids_tile=8192),
    AlignConfig("tight_br128", max_block_routes=128, tight_bins=True, grouped_scan=True, scan_experts_chunk=8,
                expert_ids_tile=8192),
    # tight_br256 on twice the warps (128 routes each): more warps to hide the sort's shuffle latency
    AlignConfig("tight_br256_w2", max_block_routes=256, routes_per_warp=128, tight_bins=True, grouped_scan=True,
                scan_experts_chunk=8, expert_ids_tile=8192),
)}


register_tunable(Tunable(
    "moe_align_block_size", ALIGN_CANDIDATES,
    lambda num_routes, num_experts: f"R={pow2_bucket(num_routes)},E={num_experts}",
    lambda num_routes, num_experts: (DEFAULT_ALIGN_CONFIG, ALIGN_CANDIDATES[DEFAULT_ALIGN_CONFIG]),
    f"{DEFAULT_ALIGN_CONFIG} at every shape"))


def align_choice(num_routes: int, num_experts: int, device=None, config: str | AlignConfig | None = None) -> Choice:
    """The alignment launch for num_routes routes over num_experts on `device`: `config` (a candidate name or an
    AlignConfig), else the tuned table (bucket R=next_pow2(routes),E), else DEFAULT_ALIGN_CONFIG."""
    return choose("moe_align_block_size", device, config, num_routes=num_routes, num_experts=num_experts)


def resolve_align_config(config: str | AlignConfig | None, num_routes: int, num_experts: int,
                         device=None) -> AlignConfig:
    """align_choice's AlignConfig (the workspace and the launch resolve it the same way, so they agree)."""
    return align_choice(num_routes, num_experts, device, config).config


def align_capacity(num_routes: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(capacity of sorted_token_ids, length of expert_ids) for these sizes: every expert's segment may end with
    block_size - 1 pad slots."""
    capacity = num_routes + num_experts * (block_size - 1)
    return capacity, triton.cdiv(capacity, block_size) if capacity else 0


def default_block_routes(num_routes: int, cfg: AlignConfig) -> int:
    """Routes per program: about `target_programs` programs (a small in-block sort each, many programs to cover the
    GPU), 128..max_block_routes routes each; the scan then reads num_routes / block_routes rows of E counts."""
    return min(cfg.max_block_routes, max(128, next_pow2(triton.cdiv(max(num_routes, 1), cfg.target_programs))))


def align_workspace_size(num_routes: int, num_experts: int, *, block_routes: int | None = None,
                         config: str | AlignConfig | None = None, device=None) -> int:
    """int32 elements of the scratch: counts [blocks, E], totals [E], and with grouped_scan the prefixes
    [blocks, E] after them (config resolved as by align_choice on `device`)."""
    cfg = resolve_align_config(config, num_routes, num_experts, device)
    num_blocks = triton.cdiv(num_routes, block_routes or default_block_routes(num_routes, cfg))
    return num_blocks * num_experts * (2 if cfg.grouped_scan else 1) + num_experts


def align_launch_shapes(num_routes: int, num_experts: int, block_size: int, block_routes: int,
                        config: str | AlignConfig | None = None, device=None) -> dict:
    """Grids and tile sizes of the three launches (host arithmetic only; the GPU script prints them)."""
    cfg = resolve_align_config(config, num_routes, num_experts, device)
    capacity, num_m_blocks = align_capacity(num_routes, num_experts, block_size)
    num_blocks = triton.cdiv(num_routes, block_routes)
    # one spare bin for skipped routes unless tight_bins; >= a warp
    num_bins = max(32, next_pow2(num_experts if cfg.tight_bins else num_experts + 1))
    # count: the histogram programs, plus more where the pad fill of sorted_token_ids is large (2048 slots each).
    count_grid = max(num_blocks, triton.cdiv(capacity, 2048))
    fill_per_program = triton.cdiv(triton.cdiv(capacity, count_grid), 16) * 16  # 64-byte aligned chunks
    # scan: chunks of experts (a 4 * chunk-byte row segment per block), tiles of <= scan_tile counts.
    experts_chunk = min(cfg.scan_experts_chunk, next_pow2(num_experts))
    group_rows = cfg.scan_group_rows if cfg.grouped_scan else num_blocks
    scan_groups = triton.cdiv(num_blocks, group_rows)
    tile_blocks = max(1, min(next_pow2(min(num_blocks, group_rows)), cfg.scan_tile // experts_chunk))
    # scatter: the route blocks, plus more where expert_ids is long: <= expert_ids_tile compares each.
    m_tile = max(1, cfg.expert_ids_tile // num_bins)
    scatter_grid = max(num_blocks, triton.cdiv(num_m_blocks, m_tile))
    m_blocks_per_program = triton.cdiv(num_m_blocks, scatter_grid)
    return dict(capacity=capacity, num_m_blocks=num_m_blocks, num_blocks=num_blocks, num_bins=num_bins,
                count_grid=count_grid, fill_per_program=fill_per_program,
                fill_block=min(1024, next_pow2(fill_per_program)),
                experts_chunk=experts_chunk, scan_grid=triton.cdiv(num_experts, experts_chunk),
                scan_groups=scan_groups, scan_group_rows=group_rows,
                tile_blocks=tile_blocks, scan_warps=max(1, min(4, tile_blocks * experts_chunk // 512)),
                scatter_grid=scatter_grid, m_blocks_per_program=m_blocks_per_program,
                tile_m_blocks=max(1, min(next_pow2(m_blocks_per_program), m_tile)),
                # At least one route per thread: tl.histogram's GPU lowering can over-count a tensor smaller than
                # the CTA (its elements are replicated across threads). routes_per_warp per warp, 1..8 warps.
                route_warps=max(1, min(8, block_routes // cfg.routes_per_warp)))
