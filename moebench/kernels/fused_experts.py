"""fused_experts (SPEC "Expert computation"): the routed experts' SwiGLU MLPs, skipping -1 routes at no GEMM cost.

    out[m] = sum over valid k of topk_weights[m,k] * (silu(x[m] @ w13[e,:I].T) * (x[m] @ w13[e,I:].T)) @ w2[e].T

`fused_experts` is the Triton path (align (moe_align_block_size's kernels) -> gate/up + SwiGLU grouped GEMM -> down
grouped GEMM with the top-k weight -> deterministic slot sum (masked_moe_sum's kernel); see `_grouped_gemm`). `fused_experts_torch` is the literal reference (fp32 by
default; bf16 compute for the eager peer), `fused_experts_grouped_mm` the torch._grouped_mm baseline.

Registered impls (target "kernel", NVTX stage "experts"):
  fused_experts.triton      the Triton path
  fused_experts.torch       eager loop over experts (bf16 matmuls, fp32 accumulate)
  fused_experts.grouped_mm  torch._grouped_mm on rows sorted by expert (CUDA sm90+ only)
  fused_experts.oblivious   the pre-fix twin: -1 read as the last local expert (python's expert_map[-1]), so
                            padded and non-local routes do GEMM work on that expert; info["corrupted_rows"]
Inputs of a point: p.num_tokens rows of make_batch's hidden states, routed by inputs.route (masked when p.mask);
global ids become rank 0's local ids through its expert map: g -> g if g < p.local_experts else -1 (non-local
routes are skipped, as on an EP rank of the all-gather path). With num_experts == local_experts every real route
is local. Weights are seeded N(0, 1/fan_in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.check import compare_close, poison
from moebench.kernels._grouped_gemm import (
    ExpertsConfig,
    align_capacity,
    align_routes,
    align_scratch_size,
    choose_config,
    down_proj,
    gate_up_swiglu,
    max_blocks,
    sum_slots,
)
from moebench.kernels._details.jit import check_triton_device, interpreting
from moebench.registry import Case, CheckResult, Impl, Routing, RunContext, register

__all__ = ["fused_experts", "fused_experts_torch", "fused_experts_grouped_mm", "ExpertsWorkspace", "make_workspace",
           "choose_config", "local_ids_rank0", "make_expert_weights"]


# ---------------------------------------------------------------------------------------------------------------
# Shapes and workspace
# ---------------------------------------------------------------------------------------------------------------

def _shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(M, K, E, H, I), or ValueError naming the inconsistent argument."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, H], got shape {tuple(x.shape)}")
    M, H = x.shape
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2I, H={H}], got shape {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2: expected [E={E}, H={H}, I={I}], got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected [M={M}, K], got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    return M, topk_ids.shape[1], E, H, I


@dataclass
class ExpertsWorkspace:
    """Everything fused_experts writes besides `out`, preallocated so a timed call allocates nothing."""

    config: ExpertsConfig
    num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    intermediate: int
    sorted_ids: torch.Tensor  # int32 [R + E*(BM-1)]
    expert_ids: torch.Tensor  # int32 [cdiv(that, BM)]
    num_post: torch.Tensor  # int32 [1]
    align_scratch: torch.Tensor  # int32 [align_scratch_size(R, E)]: moe_align_block_size's workspace
    act: torch.Tensor  # [max_blocks*BM, I] SwiGLU output per sorted position
    y: torch.Tensor  # [R, H] weighted expert output per route

    def fits(self, M: int, K: int, E: int, H: int, I: int) -> bool:
        return (self.num_tokens, self.top_k, self.num_experts, self.hidden, self.intermediate) == (M, K, E, H, I)


def make_workspace(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, *,
                   config: ExpertsConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cuda") -> ExpertsWorkspace:
    R = num_tokens * top_k
    cfg = config or choose_config(R, num_experts, hidden, intermediate)
    cap, bcap = align_capacity(R, num_experts, cfg.block_m)
    rows = max_blocks(R, num_experts, cfg.block_m) * cfg.block_m
    i32 = dict(dtype=torch.int32, device=device)
    return ExpertsWorkspace(
        cfg, num_tokens, top_k, num_experts, hidden, intermediate,
        sorted_ids=torch.empty(cap, **i32), expert_ids=torch.empty(bcap, **i32), num_post=torch.empty(1, **i32),
        align_scratch=torch.empty(align_scratch_size(R, num_experts), **i32),
        act=torch.empty(rows, intermediate, dtype=dtype, device=device),
        y=torch.empty(R, hidden, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------------------------
# The Triton path
# ---------------------------------------------------------------------------------------------------------------

def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, config: ExpertsConfig | None = None,
                  workspace: ExpertsWorkspace | None = None, out: torch.Tensor | None = None,
                  alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """SPEC fused_experts: x [M,H] bf16, w13 [E,2I,H], w2 [E,H,I], topk_weights fp32 [M,K], topk_ids [M,K] local
    ids (-1 and ids >= E skipped) -> out [M,H] in x.dtype. No host synchronisation (CUDA-graph capturable).

    `alignment`: (sorted_token_ids, expert_ids, num_tokens_post_padded) already computed for these topk_ids
    (SPEC moe_align_block_size with block_size = the config's block_m, e.g. `choose_config(M*K, E, H, I).block_m`);
    the alignment step is then skipped, so a pipeline can time it as its own stage."""
    M, K, E, H, I = _shapes(x, w13, w2, topk_weights, topk_ids)
    check_triton_device(x, w13, w2, topk_weights, topk_ids)
    if out is None:
        out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if workspace is None:
        workspace = make_workspace(M, K, E, H, I, config=config, dtype=x.dtype, device=x.device)
    elif not workspace.fits(M, K, E, H, I):
        raise ValueError("workspace was made for other shapes")
    cfg = config or workspace.config
    if cfg.block_m != workspace.config.block_m:
        raise ValueError("config.block_m differs from the workspace's")
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.float().contiguous()
    ws = workspace
    if alignment is None:
        sorted_ids, expert_ids, num_post = align_routes(
            topk_ids, E, cfg.block_m, out=(ws.sorted_ids, ws.expert_ids, ws.num_post, ws.align_scratch))
    else:
        sorted_ids, expert_ids, num_post = alignment
        cap, bcap = align_capacity(M * K, E, cfg.block_m)
        if sorted_ids.numel() < cap or expert_ids.numel() < bcap:
            raise ValueError(f"alignment: expected capacities >= ({cap}, {bcap}) for block_m={cfg.block_m}, got "
                             f"({sorted_ids.numel()}, {expert_ids.numel()})")
    gate_up_swiglu(x, w13, sorted_ids, expert_ids, num_post, K, cfg.block_m, cfg.gate_up, ws.act)
    down_proj(ws.act, w2, topk_weights, sorted_ids, expert_ids, num_post, cfg.block_m, cfg.down, ws.y)
    return sum_slots(ws.y, topk_ids, E, out, block_h=cfg.reduce_block_h)


# ---------------------------------------------------------------------------------------------------------------
# References and baselines
# ---------------------------------------------------------------------------------------------------------------

def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SPEC literally: per expert, the valid slots routed to it; h = x @ w13[e].T, a = silu(h[:, :I]) * h[:, I:],
    y = a @ w2[e].T (matmuls in `compute_dtype`; SwiGLU in fp32 then rounded to compute_dtype), then
    out[m] = sum over valid k (ascending) of topk_weights[m,k] * y_k in fp32. Output dtype: out_dtype or x.dtype."""
    M, K, E, H, I = _shapes(x, w13, w2, topk_weights, topk_ids)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    per_slot = torch.zeros(M, K, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        rows = x.index_select(0, tok).to(compute_dtype)
        h = rows @ w13[e].to(compute_dtype).T
        a = (torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()).to(compute_dtype)
        y = a @ w2[e].to(compute_dtype).T
        per_slot[tok, slot] = y.float() * topk_weights[tok, slot].float()[:, None]
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for k in range(K):
        out += torch.where(valid[:, k, None], per_slot[:, k], 0.0)
    return out.to(out_dtype or x.dtype)


def grouped_mm_available(device: torch.device) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type != "cuda":
        return "torch._grouped_mm baseline runs on CUDA only"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm needs sm90+"
    return None


def fused_experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Baseline: valid routes sorted by expert (stable), torch._grouped_mm for both GEMMs, eager SwiGLU and
    weighted slot sum. Synchronises once with the host for the number of valid routes (not graph-capturable)."""
    M, K, E, H, I = _shapes(x, w13, w2, topk_weights, topk_ids)
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)[:E]
    num_valid = int(counts.sum())
    order = order[:num_valid]
    offs = counts.cumsum(0).to(torch.int32)
    rows = x.index_select(0, order // K)
    h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
    act = (torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()).to(x.dtype)
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    per_slot = torch.zeros(M * K, H, dtype=torch.float32, device=x.device)
    per_slot[order] = y.float() * topk_weights.reshape(-1)[order].float()[:, None]
    res = per_slot.view(M, K, H).sum(1)
    if out is None:
        return res.to(x.dtype)
    out.copy_(res)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Benchmark inputs and registration
# ---------------------------------------------------------------------------------------------------------------

def local_ids_rank0(global_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Rank 0's expert map applied to global ids: g -> g for g < num_local_experts, everything else -> -1."""
    return torch.where((global_ids >= 0) & (global_ids < num_local_experts), global_ids,
                       torch.full_like(global_ids, -1)).to(torch.int32)


def make_expert_weights(num_experts: int, hidden: int, intermediate: int, *, seed: int,
                        device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded w13 [E, 2I, H] ~ N(0, 1/H) and w2 [E, H, I] ~ N(0, 1/I), generated one expert at a time (small fp32
    temporaries even for 128 x 88 MB of weights)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 7_777_777 + 12345)
    w13 = torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device)
    w2 = torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device)
    for e in range(num_experts):
        w13[e] = torch.randn(2 * intermediate, hidden, generator=g, device=device) * hidden ** -0.5
        w2[e] = torch.randn(hidden, intermediate, generator=g, device=device) * intermediate ** -0.5
    return w13, w2


def _reference_rows(num_rows: int, routes_flops: float, device: torch.device, seed: int) -> torch.Tensor | None:
    """Rows the fp32 reference is computed on: all (None) when affordable, else a seeded sample (each output row
    depends only on its own input row and routes, so a sample checks those rows exactly)."""
    budget = 4e12 if device.type == "cuda" else 2e10
    if routes_flops <= budget:
        return None
    n = max(64, int(num_rows * budget / routes_flops))
    g = torch.Generator()
    g.manual_seed(seed + 99)
    return torch.randperm(num_rows, generator=g)[:n].sort().values.to(device)


def _check_out(out: torch.Tensor, x, w13, w2, topk_weights, ids, *, seed: int) -> CheckResult:
    """out vs the fp32 reference (max-rel 5e-2, RMS/Frobenius-rel 1e-2); rows without a valid slot exactly 0."""
    M, K, E, H, I = _shapes(x, w13, w2, topk_weights, ids)
    valid = (ids >= 0) & (ids < E)
    flops = 2.0 * float(valid.sum()) * 3 * H * I
    rows = _reference_rows(M, flops, x.device, seed)
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


def _experts_info(ids: torch.Tensor, num_experts: int) -> dict:
    valid = (ids >= 0) & (ids < num_experts)
    return {"valid_routes": int(valid.sum()), "skipped_routes": int((~valid).sum()),
            "experts_used": int(torch.unique(ids[valid]).numel())}


def _build(p, ctx: RunContext, variant: str) -> Case:
    from moebench.inputs import make_batch, route

    dev = ctx.device
    batch = make_batch(p, dev)
    topk_weights, global_ids = route(p, batch)
    topk_weights = topk_weights.float().contiguous()
    E, H, I = p.local_experts, p.hidden, p.intermediate
    ids = local_ids_rank0(global_ids, E)
    x = batch.hidden
    M, K = ids.shape
    w13, w2 = make_expert_weights(E, H, I, seed=p.seed, device=dev)
    info = _experts_info(ids, E)
    # declared work is the useful work (valid routes) for every variant, so their roofline fractions compare
    valid = (ids >= 0) & (ids < E)
    n_valid = info["valid_routes"]
    tokens_read = int(valid.any(dim=1).sum())
    flops = 2 * n_valid * (H * 2 * I + I * H)
    bytes_moved = (info["experts_used"] * 3 * H * I * 2 + tokens_read * H * 2 + n_valid * (I + H) * 2 * 2
                   + M * H * 2 + M * K * 8)
    note = "weights of experts with >=1 route + x rows + act/y written+read + out (useful routes only)"
    routing_ids = global_ids
    out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    state = {"x": x, "w13": w13, "w2": w2}
    graph_ok = True

    if variant in ("triton", "oblivious"):
        ws = make_workspace(M, K, E, H, I, dtype=x.dtype, device=dev)
        info["config"] = ws.config.short()
        run_ids = ids
        if variant == "oblivious":
            # pre-fix: expert_map[-1] wraps to the last local expert; ids >= E would fault, so they stay skipped
            wrapped = torch.empty_like(ids)
            last = torch.tensor(E - 1, dtype=ids.dtype, device=dev)

            def remap():
                torch.where(ids < 0, last, ids, out=wrapped)

            remap()
            run_ids = wrapped
            info["computed_routes"] = int(((wrapped >= 0) & (wrapped < E)).sum())
            routing_ids = torch.where(global_ids < 0, torch.full_like(global_ids, E - 1), global_ids)
        state["ws"] = ws

        def run():
            if variant == "oblivious":
                remap()
            return fused_experts(x, w13, w2, topk_weights, run_ids, workspace=ws, out=out)
    elif variant == "torch":
        graph_ok = False

        def run():
            out.copy_(fused_experts_torch(x, w13, w2, topk_weights, ids, compute_dtype=torch.bfloat16))
    elif variant == "grouped_mm":
        graph_ok = False

        def run():
            return fused_experts_grouped_mm(x, w13, w2, topk_weights, ids, out=out)
    else:  # pragma: no cover
        raise ValueError(variant)

    def check() -> CheckResult:
        poison(out)
        if "ws" in state:
            poison(state["ws"].act)
            poison(state["ws"].y)
        run()
        if variant != "oblivious":
            return _check_out(out, x, w13, w2, topk_weights, ids, seed=p.seed)
        res = _check_out(out, x, w13, w2, topk_weights, run_ids, seed=p.seed)
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


def _triton_available(ctx: RunContext) -> str | None:
    if ctx.is_cuda or interpreting():
        return None
    return "Triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"


def _grouped_mm_validate(p) -> str | None:
    if p.hidden % 8 or p.intermediate % 8:
        return "hidden/intermediate: torch._grouped_mm needs multiples of 8 (16-byte rows)"
    return None


register(Impl("fused_experts.triton", targets=("kernel",), build=lambda p, ctx: _build(p, ctx, "triton"),
              description="Triton grouped GEMM: align, gate/up + SwiGLU, down + top-k weight, slot sum",
              available=_triton_available))
register(Impl("fused_experts.torch", targets=("kernel",), build=lambda p, ctx: _build(p, ctx, "torch"),
              description="eager reference: loop over experts, index_select rows, bf16 matmuls"))
register(Impl("fused_experts.grouped_mm", targets=("kernel",), build=lambda p, ctx: _build(p, ctx, "grouped_mm"),
              description="torch._grouped_mm on rows sorted by expert (+ eager SwiGLU and slot sum)",
              available=lambda ctx: grouped_mm_available(ctx.device), validate=_grouped_mm_validate))
register(Impl("fused_experts.oblivious", targets=("kernel",), build=lambda p, ctx: _build(p, ctx, "oblivious"),
              description="pre-fix twin: -1 routes computed on the last local expert",
              available=_triton_available, mask_aware=False))
