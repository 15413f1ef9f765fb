"""The layer bench family: the single-GPU MoE layer, mask-aware or not, stage by stage.

    route -> stage -> expert_map -> align -> experts -> reduce

  route       topk_softmax (Triton), or grouped_topk when num_expert_group > 1 or scoring is sigmoid (the same
              choice as inputs.route): weights fp32 [T,K], global ids int32 [T,K].
  stage       prepare_moe_inputs: fp8 e4m3 hidden + packed UE8M0 scales + int64 ids + fp32 weights (the rows an
              EP dispatch would send). With expert_dtype bf16 the experts consume the bf16 hidden states and the
              staged rows are not read further (the stage is run and timed for its cost); with fp8 the experts
              consume the staged rows and scales.
  expert_map  rank 0's map (global g -> g if g < p.local_experts else -1) applied to the staged ids.
  align       moe_align_block_size over the local experts, block size = the expert GEMMs' BLOCK_M.
  experts     the grouped_gemm gate/up + SwiGLU kernel and the down-projection kernel (which applies the top-k
              weight), fed the alignment above, writing one row per route: y [T*K, H] = [T, K, H]. expert_dtype
              fp8: fused_experts_fp8's two GEMMs on the staged rows (bench/_layer_fp8.py), 128x128-block fp8
              weights, the same alignment (at the fp8 config's block_m), y and reduce.
  reduce      masked_moe_sum over y viewed as [T, K, H].

Registered impls (target "layer", NVTX stage "layer"; every stage is also timed alone, Case.stages):
  layer.masked     route with is_padding: padded rows get -1 / 0.0 and do no work in any later stage.
  layer.oblivious  the pre-fix pipeline: the router is not given the mask, the staging ignores it, the expert
                   map is plain indexing (`expert_map[ids]`, where a -1 would wrap to the last entry) and the
                   alignment is its wrapping twin called the pre-fix way (global ids + the map, a -1 wrapping to
                   the last global expert). The unmasked router emits no -1, so padded rows are routed like real
                   tokens and processed by every stage. Non-local routes (-1 after rank 0's map) are skipped by
                   both layers, as any EP layer skips them: the two layers differ only by the padded rows' work.
                   Reduce: the pre-fix plain sum over K (moe_sum_oblivious) when every expert is local; with
                   non-local experts that plain sum would add the never-computed rows of non-local routes, so the
                   masked sum is used there (padded rows' slots hold real ids in this pipeline and are summed).

Everything is allocated in build(); run() launches the whole pipeline without a host synchronisation, so it can be
captured in a CUDA graph. Each stage function reads only what the previous stages left in the buffers, so the
runner can time it alone.
"""

from __future__ import annotations

import torch

from moebench.bench._layer_fp8 import Fp8LayerExperts, fp8_experts_work, fp8_layout_problem
from moebench.bench.experts import triton_available
from moebench.bench.routers import RouterReference, compare_routing, grouped_topk_reference, topk_softmax_reference
from moebench.bench.staging import compare_staging
from moebench.check import CheckResult, compare_close, compare_exact, poison
from moebench.inputs import cached_expert_weights, make_batch
from moebench.kernels.apply_expert_map import (
    apply_expert_map,
    apply_expert_map_oblivious_torch,
    apply_expert_map_torch,
    build_expert_map,
)
from moebench.kernels.fused_experts import expert_work, fused_experts_torch
from moebench.kernels.grouped_gemm import experts_choice, launch_tiles, max_blocks, staging_buffer
from moebench.kernels.grouped_gemm_bf16 import down_proj, gate_up_swiglu
from moebench.kernels.row_tiles import row_tile_buffers
from moebench.kernels.grouped_topk import grouped_args_problem, grouped_choice, grouped_topk
from moebench.kernels.masked_moe_sum import masked_moe_sum, moe_sum_oblivious, sum_choice
from moebench.kernels.moe_align_block_size import (
    align_capacity,
    align_choice,
    align_workspace,
    alloc_align_outputs,
    moe_align_block_size,
    moe_align_block_size_torch,
)
from moebench.kernels.prepare_moe_inputs import (
    alloc_outputs,
    prepare_moe_inputs,
    prepare_moe_inputs_oblivious,
    prepare_moe_inputs_torch,
)
from moebench.kernels.topk_softmax import MAX_TOP_K, router_limits_problem, router_outputs, softmax_choice, topk_softmax
from moebench.measure.roofline import roofline_us
from moebench.measure.cost import PointWork, layer_call_work, layer_programs
from moebench.registry import Case, Routing, RunContext, register_impl, declare_work

__all__ = ["LayerPipeline", "layer_reference_rows", "check_pipeline", "stage_work", "rows_differing", "STAGES"]

STAGES = ("route", "stage", "expert_map", "align", "experts", "reduce")

# fp32 reference budget (flops) of the whole-layer check: all rows when affordable, else a seeded sample of rows
# (each output row depends only on its own input row and routes, so a sample checks those rows exactly).
_REF_FLOPS_BUDGET = {"cuda": 3e11, "cpu": 2e10}
_OUT_FROBENIUS_LIMIT = 1e-2


def uses_grouped_router(p) -> bool:
    """The router choice of inputs.route, so the layer and the reference routing agree."""
    return p.num_expert_group > 1 or p.scoring == "sigmoid"


# ---------------------------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------------------------

class LayerPipeline:
    """Buffers and launches of one layer variant on fixed inputs. `masked=False` is the pre-fix pipeline.

    `mask` is what the mask-aware steps are given (the batch's is_padding, or None: no padding known); the
    oblivious pipeline never uses it. With p.expert_dtype fp8, w13 / w2 are unused (None): the pipeline's
    Fp8LayerExperts holds the fp8 weights and its own workspace.
    """

    def __init__(self, p, batch, w13: torch.Tensor, w2: torch.Tensor, *, masked: bool,
                 mask: torch.Tensor | None):
        self.p = p
        self.batch = batch
        self.masked = masked
        self.mask = mask if masked else None
        self.w13, self.w2 = w13, w2
        dev = batch.logits.device
        self.device = dev
        T, E = batch.logits.shape
        K, H, I, L = p.top_k, p.hidden, p.intermediate, p.local_experts
        self.T, self.E, self.K, self.H, self.I, self.L = T, E, K, H, I, L
        self.R = T * K
        self.grouped = uses_grouped_router(p)
        self.bias = batch.bias if p.bias else None
        self.expert_map = build_expert_map(E, local_experts=L, device=dev)  # EP rank 0's
        self.fp8 = Fp8LayerExperts(p, T, dev) if p.expert_dtype == "fp8" else None
        experts = self.fp8.workspace.choice if self.fp8 is not None else experts_choice(T, K, L, H, I, dev)
        self.config = experts.config
        self.block_m = self.config.block_m
        # the launch each tuned kernel of the layer takes (the launchers choose the same way), for the record
        router = (grouped_choice(T, E, K, p.num_expert_group, dev) if self.grouped
                  else softmax_choice(T, E, K, dev))
        self.choices = {c.kernel: c.record() for c in (router, align_choice(self.R, L, dev), experts,
                                                       sum_choice(T, K, H, dev))}

        # route
        self.router_out = router_outputs(T, K, dev, None)
        # stage
        self.staged = alloc_outputs(T, H, K, p.group_size, p.scale_format, dev)
        # expert map: int64 local ids (fixed kernel) / the map's int32 (plain indexing)
        if masked:
            self.local_ids = torch.empty(T, K, dtype=torch.int64, device=dev)
            self.wrapped_ids = None
        else:
            self.local_ids = torch.empty(T, K, dtype=torch.int32, device=dev)
            self.wrapped_ids = torch.empty(T, K, dtype=torch.int64, device=dev)
        # align
        self.align_out = alloc_align_outputs(self.R, L, self.block_m, dev)
        self.align_ws = align_workspace(self.R, L, dev)
        # experts: act per sorted position, y per route (fp8: in its workspace)
        if self.fp8 is not None:
            self.expert_buffers = self.fp8.buffers()
            self.y = self.fp8.y
        else:
            blocks = max_blocks(self.R, L, self.block_m)
            self.act = torch.empty(blocks * self.block_m, I, dtype=torch.bfloat16, device=dev)
            self.tile_buffers = (row_tile_buffers(self.align_out[1].numel(), dev) if self.config.paired
                                 else None)
            self.y = torch.empty(self.R, H, dtype=torch.bfloat16, device=dev)
            self.x_rows = staging_buffer(self.config.gate_up, self.config.paired, blocks * self.block_m, H,
                                         torch.bfloat16, dev)
            self.expert_buffers = (self.act, self.y)
        self.out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        # the pre-fix plain sum reads every slot: only right when every route is computed (all experts local)
        self.plain_sum = (not masked) and L == E

    # -- stages ----------------------------------------------------------------------------------------------
    def route(self) -> None:
        p, b = self.p, self.batch
        if self.grouped:
            grouped_topk(b.logits, p.top_k, p.num_expert_group, p.topk_group, scoring=p.scoring, bias=self.bias,
                         renormalize=p.renormalize, routed_scaling_factor=p.routed_scaling_factor,
                         is_padding=self.mask, out=self.router_out)
        else:
            topk_softmax(b.logits, p.top_k, p.renormalize, is_padding=self.mask, bias=self.bias,
                         out=self.router_out)

    def stage(self) -> None:
        w, ids = self.router_out
        if self.masked:
            prepare_moe_inputs(self.batch.hidden, w, ids, self.mask, self.p.group_size, self.p.scale_format,
                               out=self.staged)
        else:
            # the pre-fix staging: the mask is passed and ignored
            prepare_moe_inputs_oblivious(self.batch.hidden, w, ids, self.batch.is_padding, self.p.group_size,
                                         self.p.scale_format, out=self.staged)

    def map_experts(self) -> None:
        topk_idx = self.staged[2]
        if self.masked:
            apply_expert_map(topk_idx, self.expert_map, out=self.local_ids)
        else:
            # `expert_map[topk_idx]` with Python's wrap of negative indices, into preallocated buffers
            torch.remainder(topk_idx, self.E, out=self.wrapped_ids)
            torch.index_select(self.expert_map, 0, self.wrapped_ids.view(-1), out=self.local_ids.view(-1))

    def align(self) -> None:
        if self.masked:
            moe_align_block_size(self.local_ids, self.L, self.block_m, out=self.align_out, workspace=self.align_ws)
        else:
            moe_align_block_size(self.staged[2], self.L, self.block_m, self.expert_map, out=self.align_out,
                                 workspace=self.align_ws, wrap_negative=True)

    def experts(self) -> None:
        if self.fp8 is not None:
            self.fp8.run(self.staged, self.align_out)
            return
        sorted_ids, expert_ids, num_post = self.align_out
        tiles = launch_tiles(self.config, expert_ids, num_post, self.tile_buffers)
        gate_up_swiglu(self.batch.hidden, self.w13, sorted_ids, expert_ids, num_post, self.K, self.block_m,
                       self.config.gate_up, self.act, tiles, self.x_rows)
        down_proj(self.act, self.w2, self.staged[3], sorted_ids, expert_ids, num_post, self.block_m,
                  self.config.down, self.y, tiles)

    def reduce(self) -> None:
        y3 = self.y.view(self.T, self.K, self.H)
        if self.plain_sum:
            moe_sum_oblivious(y3, out=self.out)
        else:
            masked_moe_sum(y3, self.local_ids, out=self.out)

    def stage_fns(self) -> list[tuple[str, callable]]:
        return list(zip(STAGES, (self.route, self.stage, self.map_experts, self.align, self.experts, self.reduce)))

    def run(self) -> torch.Tensor:
        for _, fn in self.stage_fns():
            fn()
        return self.out

    def poison_all(self) -> None:
        for t in (*self.router_out, *self.staged, self.local_ids, *self.align_out, self.align_ws,
                  *self.expert_buffers, self.out):
            poison(t)
        if self.wrapped_ids is not None:
            poison(self.wrapped_ids)

    # -- what the pipeline should produce, stage by stage, from plain-torch references ---------------------
    def router_reference(self) -> RouterReference:
        p, b = self.p, self.batch
        if self.grouped:
            return grouped_topk_reference(b.logits, p.top_k, p.num_expert_group, p.topk_group, scoring=p.scoring,
                                          bias=self.bias, renormalize=p.renormalize,
                                          routed_scaling_factor=p.routed_scaling_factor, is_padding=self.mask)
        return topk_softmax_reference(b.logits, p.top_k, p.renormalize, is_padding=self.mask, bias=self.bias)

    def staging_reference(self, weights: torch.Tensor, ids: torch.Tensor):
        return prepare_moe_inputs_torch(self.batch.hidden, weights, ids, self.mask, self.p.group_size,
                                        self.p.scale_format)

    def local_ids_reference(self, topk_idx: torch.Tensor) -> torch.Tensor:
        if self.masked:
            return apply_expert_map_torch(topk_idx, self.expert_map)
        return apply_expert_map_oblivious_torch(topk_idx, self.expert_map)

    def align_reference(self, topk_idx: torch.Tensor, local_ids: torch.Tensor):
        if self.masked:
            return moe_align_block_size_torch(local_ids, self.L, self.block_m)
        return moe_align_block_size_torch(topk_idx, self.L, self.block_m, self.expert_map, wrap_negative=True)


# ---------------------------------------------------------------------------------------------------------------
# Work accounting
# ---------------------------------------------------------------------------------------------------------------

def _routing_stats(local_ids: torch.Tensor, is_padding: torch.Tensor) -> dict[str, int]:
    """Counts from local ids as the experts consume them (-1 = not processed)."""
    processed = local_ids >= 0
    pad = is_padding[:, None]
    return {"processed_routes": int(processed.sum()),
            "valid_routes": int((processed & ~pad).sum()),
            "misrouted_routes": int((processed & pad).sum()),
            "experts_hit": int(torch.unique(local_ids[processed]).numel()),
            "rows_with_routes": int(processed.any(dim=1).sum())}


def stage_work(pipe: LayerPipeline, stats: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(bytes, flops) each stage must move / do, given the routes it processes.

    Padded rows' logits are not read by a masked router; expert weights count once per expert that receives any
    route; act is written and read once per processed route, y written once; reduce reads the slots it sums.
    fp8 experts: weights, the staged rows they read and act at fp8 sizes (+ scales).
    """
    T, E, K, H, I = pipe.T, pipe.E, pipe.K, pipe.H, pipe.I
    mask = pipe.mask
    n_proc = stats["processed_routes"]
    logit_rows = T - (int(mask.sum()) if mask is not None else 0)
    route = (logit_rows * E * pipe.batch.logits.element_size() + T * K * (4 + 4)
             + (T if mask is not None else 0) + (E * 4 if pipe.bias is not None else 0))
    x_sf = pipe.staged[1]
    stage = (T * H * 2 + T * H + x_sf.numel() * x_sf.element_size() + T * K * (4 + 4) + T * K * (8 + 4)
             + (T if mask is not None else 0))
    expert_map = T * K * 8 + T * K * pipe.local_ids.element_size() + E * 4
    cap, bcap = align_capacity(pipe.R, pipe.L, pipe.block_m)
    align_in = pipe.local_ids if pipe.masked else pipe.staged[2]
    align = T * K * align_in.element_size() + (0 if pipe.masked else E * 4) + (cap + bcap + 1) * 4
    if pipe.fp8 is not None:
        experts_flops, experts_bytes = fp8_experts_work(n_proc, stats["experts_hit"], stats["rows_with_routes"], H,
                                                        I, x_sf.shape[1] * x_sf.element_size())
    else:
        experts_flops, experts_bytes = expert_work(n_proc, stats["experts_hit"], stats["rows_with_routes"], H, I)
    experts_bytes += n_proc * (4 + 4)  # the down projection's top-k weight and sorted id per route
    slots_read = T * K if pipe.plain_sum else n_proc
    reduce = slots_read * H * 2 + T * H * 2 + T * K * pipe.local_ids.element_size()
    return {"route": (route, 0), "stage": (stage, 0), "expert_map": (expert_map, 0), "align": (align, 0),
            "experts": (experts_bytes, experts_flops), "reduce": (reduce, 0)}


# ---------------------------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------------------------

def layer_reference_rows(candidates: torch.Tensor, flops_per_row: float, device: torch.device, seed: int
                         ) -> torch.Tensor:
    """Rows (ascending) of `candidates` (a bool [T] mask) the fp32 reference is computed on: all when the budget
    allows, else a seeded sample."""
    rows = candidates.nonzero().flatten()
    budget = _REF_FLOPS_BUDGET["cuda" if device.type == "cuda" else "cpu"]
    n = rows.numel()
    if n * flops_per_row <= budget:
        return rows
    keep = max(64, int(budget / max(flops_per_row, 1.0)))
    g = torch.Generator()
    g.manual_seed(seed + 4711)
    pick = torch.randperm(n, generator=g)[:keep].to(rows.device)
    return rows[pick].sort().values


def rows_differing(out: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Bool [T]: rows whose output differs from `truth` beyond bf16 noise (1e-2 of the row's max; NaN counts)."""
    diff = (out.float() - truth.float()).abs().amax(dim=1)
    scale = truth.float().abs().amax(dim=1)
    return ~(diff <= 1e-2 * scale)


def check_pipeline(pipe: LayerPipeline, *, bitwise_staging: bool, seed: int) -> CheckResult:
    """Run the pipeline on poisoned buffers and check every stage against its plain-torch reference, fed the
    previous stage's reference output (the router's own output feeds the staging reference, having been
    judged against the router reference first: near-ties may legitimately go either way)."""
    pipe.poison_all()
    pipe.run()
    results = []
    router_w, router_ids = pipe.router_out
    results.append(compare_routing(router_w, router_ids, pipe.router_reference()))

    staged_ref = pipe.staging_reference(router_w, router_ids)
    results.append(compare_staging(pipe.staged, staged_ref, bitwise=bitwise_staging, prefix="stage."))
    topk_idx_ref, topk_w_ref = staged_ref[2], staged_ref[3]

    local_ref = pipe.local_ids_reference(topk_idx_ref)
    results.append(compare_exact("local_ids", pipe.local_ids, local_ref))

    align_ref = pipe.align_reference(topk_idx_ref, local_ref)
    for name, got, want in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), pipe.align_out,
                               align_ref):
        results.append(compare_exact(name, got, want))

    # the whole layer's output against fp32 experts on the reference routing (bf16 operands as the kernels; fp8:
    # the dequantised staged rows the experts consumed, judged against the staging reference above, bit for bit
    # on a GPU, and the fp8 weights, within the derived elementwise bound)
    out = pipe.out
    is_padding = pipe.batch.is_padding
    compute_rows = ~is_padding if pipe.mask is not None else torch.ones_like(is_padding)
    flops_per_row = 2.0 * pipe.K * 3 * pipe.H * pipe.I
    rows = layer_reference_rows(compute_rows, flops_per_row, out.device, seed)
    metrics: dict[str, float] = {"out.rows_checked": float(rows.numel())}
    if rows.numel() and pipe.fp8 is not None:
        close = pipe.fp8.check_rows(out.index_select(0, rows), pipe.staged[0], pipe.staged[1], topk_w_ref,
                                    local_ref, rows)
        results.append(close)
    elif rows.numel():
        ref = fused_experts_torch(pipe.batch.hidden.index_select(0, rows), pipe.w13, pipe.w2,
                                  topk_w_ref.index_select(0, rows), local_ref.index_select(0, rows),
                                  out_dtype=torch.float32)
        got = out.index_select(0, rows).float()
        close = compare_close("out", got, ref, max_rel=5e-2, rms_rel=_OUT_FROBENIUS_LIMIT)
        num = torch.linalg.vector_norm((got - ref).double())
        den = torch.linalg.vector_norm(ref.double()).clamp_min(1e-30)
        frob = float(num / den) if bool(torch.isfinite(got).all()) else float("inf")
        close.metrics["out.frobenius_rel"] = frob
        if frob >= _OUT_FROBENIUS_LIMIT and close.ok:
            close = CheckResult(False, f"out: relative Frobenius error {frob:.3g} >= {_OUT_FROBENIUS_LIMIT}",
                                close.metrics)
        results.append(close)
    finite = torch.isfinite(out.float())
    if not bool(finite.all()):
        bad = (~finite).any(dim=1).nonzero().flatten()[:5].tolist()
        results.append(CheckResult(False, f"out: non-finite (unwritten?) rows, first {bad}"))
    if pipe.mask is not None and bool(is_padding.any()):
        nonzero_pad = int((out[is_padding] != 0).any(dim=1).sum())
        metrics["out.padded_rows_nonzero"] = float(nonzero_pad)
        if nonzero_pad:
            results.append(CheckResult(False, f"out: {nonzero_pad} padded rows are not exactly zero"))
    results.append(CheckResult(True, "", metrics))
    return CheckResult.merge(*results)


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

def layer_point_problem(p) -> str | None:
    """Why the layer cannot run at point p (its shapes, formats and router limits), or None."""
    if p.expert_dtype == "fp8" and (why := fp8_layout_problem(p)) is not None:
        return f"expert_dtype fp8: {why}"
    if p.group_size < 8 or p.group_size & (p.group_size - 1) or p.group_size > 1024:
        return f"group_size: must be a power of two in [8, 1024], got {p.group_size}"
    if p.hidden % (4 * p.group_size):
        return f"hidden: {p.hidden} is not a multiple of 4*group_size={4 * p.group_size}"
    if p.top_k > MAX_TOP_K:
        return f"top_k: {p.top_k} > {MAX_TOP_K}"
    if not 1 <= p.local_experts <= p.num_experts:
        return f"num_local_experts: {p.local_experts} not in [1, num_experts={p.num_experts}]"
    why = router_limits_problem(p.num_experts, p.top_k)
    if why is None and uses_grouped_router(p):
        why = grouped_args_problem(p.num_experts, p.top_k, p.num_expert_group, p.topk_group, p.scoring, p.bias)
    return why


def _build(variant: str):
    masked = variant == "masked"

    def build(p, ctx: RunContext) -> Case:
        dev = ctx.device
        batch = make_batch(p, dev)
        if p.expert_dtype == "fp8":
            w13 = w2 = None  # the pipeline's fp8 experts quantise (once per weight key) and hold the weights
        else:
            w13, w2 = cached_expert_weights(p.local_experts, p.hidden, p.intermediate, p.seed, dev)
        pipe = LayerPipeline(p, batch, w13, w2, masked=masked, mask=batch.mask)

        # Work from the reference routing (the check then holds the kernels to it).
        ref_router = pipe.router_reference()
        ref_idx = ref_router.ids.to(torch.int64)
        ref_local = pipe.local_ids_reference(ref_idx)
        stats = _routing_stats(ref_local, batch.is_padding)
        work = stage_work(pipe, stats)
        stage_roofs = {name: roofline_us(flops, nbytes, fp8=pipe.fp8 is not None and name == "experts")
                       for name, (nbytes, flops) in work.items()}
        bytes_moved = sum(nbytes for nbytes, _ in work.values())
        flops = sum(f for _, f in work.values())
        info = {**stats, "expert_dtype": p.expert_dtype, "stage_roofline_us": stage_roofs, "stage_bytes": {k: v[0] for k, v in work.items()},
                "block_m": pipe.block_m, "config": pipe.config.short(),
                "configs": {k: v for k, v in pipe.choices.items() if k != "masked_moe_sum" or not pipe.plain_sum},
                "router": "grouped_topk" if pipe.grouped else "topk_softmax",
                "reduce": "moe_sum_oblivious" if pipe.plain_sum else "masked_moe_sum",
                "num_local_experts": pipe.L, "masked": pipe.mask is not None}
        state = {"pipe": pipe}

        def check() -> CheckResult:
            steps = 2 if pipe.mask is not None else 3
            ctx.progress(0, steps, "layer check steps", "the pipeline against each stage's reference")
            res = check_pipeline(pipe, bitwise_staging=ctx.is_cuda, seed=p.seed)
            ctx.progress(1, steps, "layer check steps", "the harm: rows that differ from the mask-aware layer")
            # Measured from the alignment the experts consumed: which routes were processed, of which rows.
            sorted_ids, expert_ids, num_post = (t.cpu() for t in pipe.align_out)
            placed = sorted_ids[:int(num_post)]
            placed = placed[placed < pipe.R].long()
            from_padding = batch.is_padding.cpu()[placed // pipe.K]
            info["misrouted_routes"] = int(from_padding.sum())
            info["valid_routes"] = int((~from_padding).sum())
            info["experts_hit"] = int(torch.unique(expert_ids[:int(num_post) // pipe.block_m]).numel())
            # The harm: rows whose output differs from the mask-aware layer's.
            if pipe.mask is not None:
                truth_out = pipe.out  # this is the mask-aware layer
                corrupted = (batch.is_padding & (pipe.out != 0).any(dim=1)) | ~torch.isfinite(pipe.out).all(dim=1)
            else:
                truth = LayerPipeline(p, batch, w13, w2, masked=True, mask=batch.is_padding)
                truth_out = truth.run()
                corrupted = rows_differing(pipe.out, truth_out)
                del truth
            ctx.progress(steps, steps, "layer check steps")
            info["corrupted_rows"] = int(corrupted.sum())
            info["corrupted_padded_rows"] = int((corrupted & batch.is_padding).sum())
            res.metrics["corrupted_rows"] = float(info["corrupted_rows"])
            res.metrics["misrouted_routes"] = float(info["misrouted_routes"])
            return res

        def cleanup() -> None:
            state.clear()

        stage_fns = pipe.stage_fns()  # timed alone, and run() in order (the profiler's pipeline)
        return Case(run=pipe.run, check=check, bytes_moved=bytes_moved, flops=flops,
                    bytes_note="sum over stages: logits (real rows when masked), staging in/out, ids maps, "
                               "alignment, weights of experts hit + x rows + act/y per processed route, reduce "
                               "slots read + out",
                    roofline_us=sum(stage_roofs.values()) if ctx.is_cuda else None,
                    routing=Routing(pipe.router_out[1], batch.is_padding, p.num_experts, p.ep_size),
                    stages=stage_fns, pipeline=stage_fns, info=info, nvtx_stage="layer",
                    cleanup=cleanup)
    return build


_DESCRIPTIONS = {
    "masked": "route (is_padding) -> fp8 staging -> expert map -> align -> grouped GEMMs -> masked sum; padded "
              "rows do no work",
    "oblivious": "pre-fix layer: unmasked router, mask-ignoring staging, plain-indexing map, wrapping align: "
                 "padded rows routed and computed like real tokens",
}
for _variant in ("masked", "oblivious"):
    register_impl(f"layer.{_variant}", targets=("layer",), description=_DESCRIPTIONS[_variant],
                  available=triton_available, validate=layer_point_problem,
                  twin_of="layer.masked" if _variant == "oblivious" else None)(_build(_variant))


# about 30 launch-equivalents a call (the GEMM grids count several); its six stages are timed alone too
declare_work("layer", PointWork(call=layer_call_work, launches=30, stages_alone=6, programs=layer_programs))
