"""The expert-computation bench family (target "kernel", NVTX stage "experts"):
  fused_experts.triton      the Triton path
  fused_experts.torch       eager loop over experts (bf16 matmuls, fp32 accumulate)
  fused_experts.oblivious   the pre-fix twin: -1 read as the last local expert (python's expert_map[-1]), so
                            padded and non-local routes do GEMM work on that expert; info["corrupted_rows"]
The torch._grouped_mm peer lives in moebench.peers.torch_grouped, the GEMM ceiling in bench.experts_ceiling; both
take this family's inputs (`experts_inputs`).
Inputs of a point: p.num_tokens rows of make_batch's hidden states, routed by inputs.route (masked when p.mask);
global ids become rank 0's local ids through its expert map: g -> g if g < p.local_experts else -1 (non-local
routes are skipped, as on an EP rank of the all-gather path). With num_experts == local_experts every real route
is local. Weights are seeded N(0, 1/fan_in) (inputs.make_expert_weights).

Declared work is kernels.fused_experts.expert_work over the useful (valid) routes, for every variant, so their
roofline fractions compare. `check_experts_out` (the fp32 reference on all rows, or a seeded sample when that is
too costly) is shared with ep_sim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.check import CheckResult, compare_close, poison
from moebench.families import KernelFamily, register_family
from moebench.inputs import make_batch, make_expert_weights, route
from moebench.inputs.batch import Batch
from moebench.kernels.runtime import interpreting
from moebench.kernels.apply_expert_map import apply_expert_map_torch, build_expert_map
from moebench.kernels.fused_experts import (
    experts_choice,
    expert_shapes,
    expert_work,
    fused_experts,
    fused_experts_torch,
    make_workspace,
)
from moebench.measure.cost import PointWork, expected_expert_work, fused_experts_programs
from moebench.registry import Case, Routing, RunContext, register_impl, declare_work

__all__ = ["interpreted_reduce_block_h", "reference_rows", "check_experts_out", "experts_info", "expert_rows", "equal_rows", "row_tiles", "triton_available", "ExpertsInputs",
           "experts_inputs", "oblivious_ids"]


def reference_rows(num_rows: int, routes_flops: float, device: torch.device, seed: int) -> torch.Tensor | None:
    """Rows the fp32 reference is computed on: all (None) when affordable, else a seeded sample (each output row
    depends only on its own input row and routes, so a sample checks those rows exactly)."""
    budget = 4e12 if device.type == "cuda" else 2e10
    if routes_flops <= budget:
        return None
    n = max(64, int(num_rows * budget / routes_flops))
    g = torch.Generator()
    g.manual_seed(seed + 99)
    return torch.randperm(num_rows, generator=g)[:n].sort().values.to(device)


def check_experts_out(out: torch.Tensor, x, w13, w2, topk_weights, ids, *, seed: int) -> CheckResult:
    """out vs the fp32 reference (max-rel 5e-2, RMS/Frobenius-rel 1e-2); rows without a valid slot exactly 0."""
    M, K, E, H, I = expert_shapes(x, w13, w2, topk_weights, ids)
    valid = (ids >= 0) & (ids < E)
    flops = 2.0 * float(valid.sum()) * 3 * H * I
    rows = reference_rows(M, flops, x.device, seed)
    sel = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    ref = fused_experts_torch(sel(x), w13, w2, sel(topk_weights), sel(ids), out_dtype=torch.float32)
    got = sel(out).float()
    res = compare_close("out", got, ref, max_rel=5e-2, rms_rel=1e-2)
    frob = (torch.linalg.vector_norm((got - ref).double()) / torch.linalg.vector_norm(ref.double()).clamp_min(1e-30))
    res.metrics["out.frobenius_rel"] = float(frob)
    res.metrics["out.rows_checked"] = float(got.shape[0])
    empty_rows = ~valid.any(dim=1)
    checks = [res]
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).any(dim=1).nonzero().flatten()[:5].tolist()
        checks.append(CheckResult(False, f"out: non-finite (unwritten?) rows, first {bad}"))
    if bool(empty_rows.any()) and bool((out[empty_rows] != 0).any()):
        checks.append(CheckResult(False, "out: rows without a valid route are not zero"))
    return CheckResult.merge(*checks)


def experts_info(ids: torch.Tensor, num_experts: int) -> dict:
    valid = (ids >= 0) & (ids < num_experts)
    return {"valid_routes": int(valid.sum()), "skipped_routes": int((~valid).sum()),
            "experts_used": int(torch.unique(ids[valid]).numel()),
            "row_tiles": row_tiles(expert_rows(ids, num_experts))}


def expert_rows(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: the valid routes (ids in [0, E)) per expert: each expert's rows in the grouped GEMMs."""
    flat = ids.reshape(-1).long()
    return torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)


def equal_rows(num_rows: int, num_experts: int, device=None) -> torch.Tensor:
    """int64 [E]: num_rows split as evenly as E groups allow (the equal-group ceiling's groups)."""
    return num_rows // num_experts + (torch.arange(num_experts, device=device) < num_rows % num_experts).long()


ROW_TILE_SIZES = (64, 128)  # the row tiles of the expert GEMMs' wgmma configs


def row_tiles(counts: torch.Tensor) -> dict:
    """Where uneven experts lose GEMM work, per row-tile size BM: {BM: {tiles: sum_e ceil(c_e / BM), equal_tiles:
    the same for equal_rows (the same rows over the same E groups, evenly), efficiency: rows / (tiles * BM)}} from
    per-expert row counts. A grouped GEMM of BM-row tiles computes tiles * BM rows for `rows` useful ones:
    efficiency is the ceiling on its speed against full tiles, and tiles / equal_tiles what the uneven sizes cost
    at that BM; "64x2" is the paired launch's tiling (its tiles, half_tiles among them)."""
    c = counts.tolist()
    rows = sum(c)
    equal = equal_rows(rows, len(c)).tolist()
    out = {}
    for bm in ROW_TILE_SIZES:
        tiles = sum(-(-v // bm) for v in c)
        out[str(bm)] = {"tiles": tiles, "equal_tiles": sum(-(-v // bm) for v in equal),
                        "efficiency": round(rows / (tiles * bm), 4) if tiles else None}
    # the paired launch bm64x2_tma (kernels.row_tiles): 64-row blocks two a tile, an expert's odd last block alone;
    # as many tiles as 128-row ones (ceil(ceil(c / 64) / 2) = ceil(c / 128)), half_tiles of them narrow, so it
    # computes the 64-row tiles' rows
    def pairs(counts):
        return sum(-(-(-(-v // 64)) // 2) for v in counts)  # ceil(ceil(v / 64) / 2)

    out["64x2"] = {"tiles": pairs(c), "half_tiles": sum(-(-v // 64) % 2 for v in c), "equal_tiles": pairs(equal),
                   "efficiency": out["64"]["efficiency"]}
    return out


def wrap_minus_one(ids: torch.Tensor, local_experts: int):
    """The oblivious twins' pre-fix ids: -1 read as the last local expert (python's expert_map[-1]).

    Returns (wrapped, remap): `wrapped` is filled once here, and `remap()` refills it in place inside a timed run
    (the remap is part of the pre-fix cost)."""
    wrapped = torch.empty_like(ids)
    last = torch.tensor(local_experts - 1, dtype=ids.dtype, device=ids.device)

    def remap():
        torch.where(ids < 0, last, ids, out=wrapped)

    remap()
    return wrapped, remap


def oblivious_ids(ids: torch.Tensor, routing_ids: torch.Tensor, local_experts: int, info: dict):
    """An oblivious twin's ids: (run_ids, remap, routing_ids). run_ids and remap are wrap_minus_one's; the routing
    reads -1 as the last local expert too; info["computed_routes"] counts the routes the pre-fix kernel computes
    (ids >= E would fault, so they stay skipped)."""
    E = local_experts
    wrapped, remap = wrap_minus_one(ids, E)
    info["computed_routes"] = int(((wrapped >= 0) & (wrapped < E)).sum())
    return wrapped, remap, torch.where(routing_ids < 0, torch.full_like(routing_ids, E - 1), routing_ids)


@dataclass
class ExpertsInputs:
    """A bf16 point's inputs: the batch, its rows, the expert weights, the routes (rank 0's local ids)."""

    batch: Batch
    x: torch.Tensor  # bf16 [M, H]
    w13: torch.Tensor  # bf16 [E, 2I, H]
    w2: torch.Tensor  # bf16 [E, H, I]
    topk_weights: torch.Tensor  # fp32 [M, K]
    ids: torch.Tensor  # int32 [M, K] local, -1 skipped
    global_ids: torch.Tensor  # [M, K] the router's global ids


def experts_inputs(p, ctx: RunContext) -> ExpertsInputs:
    dev = ctx.device
    batch = make_batch(p, dev)
    topk_weights, global_ids = route(p, batch)
    E, H, I = p.local_experts, p.hidden, p.intermediate
    # rank 0's expert map: g -> g if g < E (its local experts) else -1
    expert_map = build_expert_map(p.num_experts, local_experts=E, device=global_ids.device)
    ids = apply_expert_map_torch(global_ids, expert_map).to(torch.int32)
    w13, w2 = make_expert_weights(E, H, I, seed=p.seed, device=dev)
    return ExpertsInputs(batch, batch.hidden, w13, w2, topk_weights.float().contiguous(), ids, global_ids)


def _build(p, ctx: RunContext, variant: str, fn=None) -> Case:
    dev = ctx.device
    inp = experts_inputs(p, ctx)
    batch, x, w13, w2, topk_weights, ids, global_ids = (inp.batch, inp.x, inp.w13, inp.w2, inp.topk_weights,
                                                         inp.ids, inp.global_ids)
    E, H, I = p.local_experts, p.hidden, p.intermediate
    M, K = ids.shape
    info = experts_info(ids, E)
    info["expert_dtype"] = "bf16"  # the GEMM ceiling a record is paired with (report.ceiling)
    # declared work is the useful work (valid routes) for every variant, so their roofline fractions compare
    valid = (ids >= 0) & (ids < E)
    tokens_read = int(valid.any(dim=1).sum())
    flops, bytes_moved = expert_work(info["valid_routes"], info["experts_used"], tokens_read, H, I, out_rows=M,
                                     top_k=K)
    note = "weights of experts with >=1 route + x rows + act/y written+read + out (useful routes only)"
    routing_ids = global_ids
    out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    state = {"x": x, "w13": w13, "w2": w2}
    graph_ok = True

    if variant in ("triton", "oblivious"):
        ws = make_workspace(M, K, E, H, I, dtype=x.dtype, device=dev, config=p.config if variant == "triton" else None)
        info.update(ws.choice.record(), config_detail=ws.config.short())
        run_ids = ids
        if variant == "oblivious":  # pre-fix: expert_map[-1] wraps to the last local expert
            run_ids, remap, routing_ids = oblivious_ids(ids, routing_ids, E, info)
        state["ws"] = ws

        def run():
            if variant == "oblivious":
                remap()
            return fused_experts(x, w13, w2, topk_weights, run_ids, workspace=ws, out=out)
    elif variant == "torch":
        graph_ok = False

        def run():
            out.copy_(fused_experts_torch(x, w13, w2, topk_weights, ids, compute_dtype=torch.bfloat16))
    elif variant == "fn":
        def run():
            return fn(x, w13, w2, topk_weights, ids, out=out)
    else:  # pragma: no cover
        raise ValueError(variant)

    def check() -> CheckResult:
        poison(out)
        if "ws" in state:
            poison(state["ws"].act)
            poison(state["ws"].y)
        got = run()
        if variant == "fn":  # an outside implementation is judged by what it returns
            return check_experts_out(got, x, w13, w2, topk_weights, ids, seed=p.seed)
        if variant != "oblivious":
            return check_experts_out(out, x, w13, w2, topk_weights, ids, seed=p.seed)
        res = check_experts_out(out, x, w13, w2, topk_weights, run_ids, seed=p.seed)
        # the harm: rows whose result differs from the masked computation
        masked = fused_experts(x, w13, w2, topk_weights, ids, workspace=state["ws"])
        diff = (out.float() - masked.float()).abs().amax(dim=1)
        scale = masked.float().abs().amax(dim=1)
        corrupted = ~(diff <= 1e-2 * scale)  # NaN counts as corrupted
        info["corrupted_rows"] = int(corrupted.sum())
        res.metrics["corrupted_rows"] = float(info["corrupted_rows"])
        return res

    def cleanup():
        state.clear()

    return Case(run=run, check=check, bytes_moved=bytes_moved, flops=flops, bytes_note=note,
                routing=Routing(routing_ids, batch.is_padding, p.num_experts, p.ep_size),
                graph_capturable=graph_ok, info=info, nvtx_stage="experts", cleanup=cleanup)


def triton_available(ctx: RunContext) -> str | None:
    """None where the Triton kernels can run (a GPU, or the CPU interpreter), else why not."""
    if ctx.is_cuda or interpreting():
        return None
    return "Triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"


@register_impl("fused_experts.triton", targets=("kernel",), available=triton_available, tuned_kernel="fused_experts",
               description="Triton grouped GEMM: align, gate/up + SwiGLU, down + top-k weight, slot sum")
def _build_triton(p, ctx: RunContext) -> Case:
    return _build(p, ctx, "triton")


@register_impl("fused_experts.torch", targets=("kernel",), baseline=True,
               description="eager reference: loop over experts, index_select rows, bf16 matmuls")
def _build_torch(p, ctx: RunContext) -> Case:
    return _build(p, ctx, "torch")


@register_impl("fused_experts.oblivious", targets=("kernel",), available=triton_available,
               twin_of="fused_experts.triton", description="pre-fix twin: -1 routes computed on the last local expert")
def _build_oblivious(p, ctx: RunContext) -> Case:
    return _build(p, ctx, "oblivious")


register_family(KernelFamily(
    "fused_experts", ("kernel",), lambda fn: lambda p, ctx: _build(p, ctx, "fn", fn),
    "fn(x bf16 [T,H], w13 bf16 [E,2I,H], w2 bf16 [E,H,I], topk_weights fp32 [T,K], topk_ids int32 [T,K] local "
    "(-1 skipped), out=bf16 [T,H]) -> bf16 [T,H]: sum_k w_k * w2[e] @ (silu(gate) * up)"))


def interpreted_reduce_block_h(p, rows: int, local_experts: int) -> int:
    """The columns the bf16 fused_experts' slot sum asks for in the interpreter: the rule's config's reduce_block_h
    (a `config:` candidate asks for up to 1024, the same block up to 256 columns: the CPU sizes' widest hidden)."""
    return experts_choice(rows, p.top_k, local_experts, p.hidden, p.intermediate, "cpu").config.reduce_block_h


# the family's every variant (bf16, ceilings, peers; fp8 declares its own slot sum): the grouped GEMMs over the
# point's local experts; a GEMM grid costs several launch-equivalents; in the interpreter the call's alignment and
# slot sum count too
declare_work("fused_experts", PointWork(
    call=lambda p: expected_expert_work(p, p.num_tokens, p.local_experts), launches=12,
    programs=lambda p: fused_experts_programs(p, p.num_tokens, p.local_experts,
                                              interpreted_reduce_block_h(p, p.num_tokens, p.local_experts))))
