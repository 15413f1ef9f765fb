"""The dispatch paths as timed impls (target "dispatch", one process per EP rank): one impl `dispatch.<name>` per
path moebench.dispatch.base.package_paths() finds, each built by the same Case builder through the paths' hooks.

build(p, ctx) runs on every rank of ctx.group (ctx.world_size == p.ep_size): this rank's padded batch from
make_batch(p, seed_offset=rank), routed with the mask when p.mask (mask-aware: padded rows are not sent) or
without (oblivious: padded rows travel with whatever experts they picked). run() = dispatch + a cheap exact expert
(`scaled_expert`: expert e scales its rows by e + 1, weighted) + combine; the stages "dispatch" and "combine" are
exposed too (timed alone), and run() split into dispatch / experts / combine as the profiler's pipeline. check()
compares the received rows bitwise with the single-process reference computed from every rank's gathered inputs,
the combined output with what one process holding all experts computes (bf16 tolerance), that padded rows are
never sent when masked, and whatever the path's `extra_checks` add.

A path defined outside moebench.dispatch (a test, a plugin) is registered with `register_path_impl(cls)`.
"""

from __future__ import annotations

from typing import Callable

import torch

from moebench.check import compare_close, poison
from moebench.dispatch.base import DispatchPath, EPLayout, effective_ids, package_paths
from moebench.dispatch.pack import CapacityKnobs
from moebench.dispatch.reference import (
    check_received,
    count_padding_received,
    gather_inputs,
    padded_rows_sent,
    scaled_expert,
    scaled_expert_reference,
)
from moebench.families import set_path_registrar
from moebench.params import Params
from moebench.measure.cost import PointWork
from moebench.registry import Case, CheckResult, Routing, RunContext, register_impl, declare_work

COMBINE_MAX_REL = 2e-2  # partial sums are rounded to bf16 on each rank before they are added
COMBINE_RMS_REL = 5e-3
CHECK_SEED_SALT = 17  # the check's generator (garbage for prepare_check) draws from its own stream


def case_builder(path_cls: type[DispatchPath]) -> Callable[[Params, RunContext], Case]:
    """build(p, ctx) -> Case for the path class (see the module docstring)."""
    name = path_cls.name

    def build(p: Params, ctx: RunContext) -> Case:
        from moebench import inputs

        if ctx.world_size != p.ep_size:
            raise ValueError(f"dispatch.{name}: ep_size {p.ep_size} needs {p.ep_size} ranks, this group has "
                             f"{ctx.world_size}")
        layout = EPLayout.of(p, rank=ctx.rank, group=ctx.group if p.ep_size > 1 else None)
        batch = inputs.make_batch(p, ctx.device, seed_offset=ctx.rank)
        topk_weights, topk_ids = inputs.route(p, batch)  # -1 on padded rows when p.mask
        x, mask = batch.hidden, batch.mask
        T = x.shape[0]
        buffer_rows = p.knobs(CapacityKnobs).num_max_tokens_per_rank
        if path_cls.buffers_sized_by_max_tokens and T > buffer_rows:
            raise ValueError(f"{T} rows per rank exceed num_max_tokens_per_rank={buffer_rows}")
        path = path_cls.from_point(layout, p, topk_ids, mask, ctx.device)
        out = torch.empty_like(x)

        def expert(d):
            return scaled_expert(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)

        def run():
            d = path.dispatch(x, topk_ids, topk_weights, mask)
            return path.combine(expert(d), d.handle, out=out)

        # One untimed round trip: compiles kernels, sizes the traffic, and feeds the combine-only stage.
        d0 = path.dispatch(x, topk_ids, topk_weights, mask)
        y0 = expert(d0)
        path.combine(y0, d0.handle, out=out)
        stats = path.stats(d0)

        def run_dispatch():
            return path.dispatch(x, topk_ids, topk_weights, mask)

        def run_combine():
            return path.combine(y0, d0.handle, out=out)

        # run() in its three phases, for the profiler's per-phase NVTX ranges (each reads what the last left)
        phase: dict = {}

        def phase_dispatch():
            phase["d"] = path.dispatch(x, topk_ids, topk_weights, mask)

        def phase_experts():
            phase["y"] = expert(phase["d"])

        def phase_combine():
            return path.combine(phase.pop("y"), phase.pop("d").handle, out=out)

        ids_eff = effective_ids(topk_ids, mask)
        sent_padding = padded_rows_sent(path, ids_eff, batch.is_padding)

        def check() -> CheckResult:
            path.prepare_check(torch.Generator(device=ctx.device).manual_seed(p.seed + CHECK_SEED_SALT + ctx.rank))
            poison(out)
            d = path.dispatch(x, topk_ids, topk_weights, mask)
            path.combine(expert(d), d.handle, out=out)
            g = gather_inputs(x, topk_ids, topk_weights, batch.is_padding, mask is not None, layout)
            results = [check_received(path, d, g)]
            ref = scaled_expert_reference(x, ids_eff, topk_weights, layout.local_experts)
            results.append(compare_close("combined", out, ref, COMBINE_MAX_REL, COMBINE_RMS_REL))
            pads = count_padding_received(path, d, g)
            metrics = {k: float(v) for k, v in pads.items()}
            if mask is not None:
                # a path receiving every row moves padded rows by construction; masked, they must carry no route
                key = "padded_routes_received" if path.receives == "all" else "padded_rows_received"
                if pads[key]:
                    results.append(CheckResult(False, f"mask-aware {name} received {pads[key]} padded rows "
                                                      f"({key})", {}))
            results.extend(path.extra_checks(d))
            results.append(CheckResult(True, "", metrics))
            return CheckResult.merge(*results)

        info = {**stats.as_info(), "padded_rows_sent": sent_padding, "path": path.name,
                "receives": path.receives, "mask_aware": mask is not None, **path.record_info(p)}
        return Case(run=run, check=check,
                    bytes_moved=stats.recv_payload_bytes + stats.combine_recv_bytes,
                    bytes_note="payload received by this rank, dispatch (hidden + ids + weights per row) + combine "
                               "(hidden per row); own-rank rows included (own share in info); wire bytes in info",
                    routing=Routing(topk_ids, batch.is_padding, p.num_experts, p.ep_size),
                    graph_capturable=path.graph_capturable,
                    stages=[("dispatch", run_dispatch), ("combine", run_combine)],
                    pipeline=[("dispatch", phase_dispatch), ("experts", phase_experts), ("combine", phase_combine)],
                    info=info, nvtx_stage="dispatch", cleanup=path.close)
    return build


def register_path_impl(path_cls: type[DispatchPath]) -> None:
    """Register the path as the timed impl `dispatch.<name>` (multi-rank: one process per EP rank)."""
    register_impl(f"dispatch.{path_cls.name}", targets=("dispatch",), description=path_cls.description,
                  available=path_cls.available, validate=path_cls.validate, multi_rank=True)(case_builder(path_cls))
    declare_work(f"dispatch.{path_cls.name}", PointWork(
        call=dispatch_work, launches=8, programs=lambda p: path_cls.interpreter_programs_per_row * p.num_tokens))


def dispatch_work(p: Params) -> tuple[float, float]:
    """Dispatch and combine of the point's rows: top_k copies of each row out and back."""
    return 0.0, p.num_tokens * p.top_k * p.hidden * 4.0


for _path_cls in package_paths().values():
    register_path_impl(_path_cls)
set_path_registrar(register_path_impl)  # moebench.plugins.register_dispatch_path goes through it

