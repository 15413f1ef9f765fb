"""What a serving_trace point costs, before it runs (declared at registration: moebench.measure.cost.PointWork).

The point's time is what it times plus what it composes, counted from the trace itself (its distinct steps and
shapes, made on the host in seconds, no routing and no timing):
  shapes         the shapes the plan times (every distinct one up to trace_shape_timings, else that many; the
                 interpolation grid's for trace_real_points > 0), both sides, each a pipeline built and its layer
                 called SHAPE_CALLS times (the settled samples on a GPU; the check's call and one timed in the
                 interpreter), at the mean rows of the shapes it may time (the interpreter times none over
                 TIMED_ROWS_MAX);
  rank workloads min(ep_rank_timings, the steps' rank workloads) expert-kernel timings: the design at a rank's
                 mean routes, the decisive ones at the slowest rank's (rank_seconds), bounded by ep_rank_seconds;
  replay         the replayed steps' calls (both sides) and every EP rank of theirs, timed afresh;
  host           the routing and the composition over arrays: a fixed cost, HOST_S_PER_STEP per distinct step,
                 HOST_S_PER_RANK_STEP per distinct step and EP rank, HOST_S_PER_SHAPE per shape, and the EP step's
                 source slots' routed rows (routed_rows);
  the point's own  its check (both sides' layers and references at the most padded shape it may time) and its timed
                 run (RUN_CALLS calls of the layer at the most frequent call shape).
The distinct steps and shapes are counted over the first ESTIMATE_STEPS distinct steps and scaled to all of them.
"""

from __future__ import annotations

from dataclasses import replace

from moebench.measure.cost import (INTERP_PROGRAM_S, DeviceRates, expected_expert_work, expert_programs,
                                   layer_call_work, layer_programs)
from moebench.measure.timing import SETTLED_SAMPLED_US
from moebench.params import Params

SHAPE_CALLS = {"cuda": 12, "interpreter": 2, "cpu": 2}  # calls a timed shape side costs (untimed + samples)
# a side's pipeline built, its graph captured (an H100: 192 shapes of kimi-k2 at EP 8, both sides, in 87.6 s)
SHAPE_BUILD_S = {"cuda": 0.2, "interpreter": 0.05, "cpu": 0.05}
RANK_CALLS = {"cuda": 10, "interpreter": 1, "cpu": 1}
RANK_BUILD_S = 0.005
RANK_COMPILE_S = 5.0  # a GPU's first workload of a launch config compiles its kernels (3 to 9 s on an H100)
HEAVY_RANK = 1.5  # the slowest rank's routes over the mean's, the padding aside (routing skew)
RANK_ROOF_SHARE = 0.6  # of the roofline a rank's grouped GEMM reaches (docs/benchmarks.md: the expert kernels)
# the host's arrays (project CPU machines, a 1,000,000-step trace of 381,093 distinct steps and 338,809 shapes at
# EP 64: composition 32 s, the EP step's source slots routed 12 s): per distinct step, per distinct step and EP
# rank, per shape (its figures and priced time), and per routed row of the EP step's source slots
HOST_S_FIXED = 2.0
HOST_S_PER_STEP = 2e-5
HOST_S_PER_RANK_STEP = 1e-6
HOST_S_PER_SHAPE = 3e-5
ROUTE_S_PER_ROW = {"cuda": 2e-7, "interpreter": 2e-5, "cpu": 2e-5}
RUN_CALLS = 22  # the point's timed run: warm-up and iterations of the sweep's timing (20 by default)
CHECK_CALLS = 4  # both sides' layers and their references
ESTIMATE_STEPS = 20_000


def planned(p: Params) -> dict[str, float]:
    """What the point will time and compose: distinct steps, shapes, timed shapes and their mean rows, calls per
    step, and the EP ranks' workloads (a step's sides and micro-batches, each of ep_size ranks)."""
    from moebench.bench.serving_trace.compose import distinct_shapes, interpolation_shapes
    from moebench.bench.serving_trace.knobs import ServingKnobs
    from moebench.bench.serving_trace.plan import TIMED_ROWS_MAX
    from moebench.bench.serving_trace.trace_input import engine_of, trace_tokens
    from moebench.inputs.engine_padding import step_padding

    serving = p.knobs(ServingKnobs)
    trace, _ = trace_tokens(p)
    engine = engine_of(p)
    steps = [step_padding(real, engine) for real in trace.steps[:ESTIMATE_STEPS]]
    scale = len(trace.steps) / max(1, len(steps))
    shapes = distinct_shapes(steps)
    return {"distinct_steps": len(trace.steps), "shapes": len(shapes) * scale, "shape_list": shapes,
            "max_real": max((c.real for s in steps for c in s.calls), default=1),
            "interpolated": len(interpolation_shapes(steps, serving.trace_real_points))
            if serving.trace_real_points else None,
            "calls_per_step": sum(len(s.calls) for s in steps) / max(1, len(steps)),
            "micro_batches": sum(len({c.micro_batch for c in s.calls}) for s in steps) / max(1, len(steps)),
            "budget": {kind: serving.shape_timings(kind) for kind in ("cuda", "cpu")},
            "rows_max": TIMED_ROWS_MAX}


def routed_rows(p: Params, plan: dict) -> int:
    """Rows the EP step's source slots route: every slot its real stream, and its padding's (one row where every
    padded row is the same: zeros, repeat)."""
    from moebench.bench.serving_trace.knobs import ServingKnobs
    from moebench.bench.serving_trace.shape_streams import stream_size

    if p.ep_size <= 1:
        return 0
    serving = p.knobs(ServingKnobs)
    slots = max(p.ep_size, serving.dp_size * serving.sp_size)
    real = stream_size(plan["max_real"])
    return slots * (real + (1 if p.padding_fill in ("zeros", "repeat") else real))


def point_seconds(p: Params, rates: DeviceRates) -> float:
    """Seconds of one serving_trace point on a device of `rates` (the module docstring)."""
    from moebench.bench.serving_trace.knobs import ServingKnobs

    serving = p.knobs(ServingKnobs)
    plan = planned(p)
    device = "cuda" if rates.is_cuda else "cpu"
    rows_max = plan["rows_max"][device]
    timeable = [s for s in plan["shape_list"] if rows_max is None or s[0] <= rows_max] or plan["shape_list"][:1]
    budget = plan["budget"][device]
    if plan["interpolated"] is not None:
        timed = plan["interpolated"]
    elif plan["shapes"] <= budget and len(timeable) == len(plan["shape_list"]):
        timed = plan["shapes"]  # exact: every shape
    else:
        timed = min(budget, len(timeable))
    mean_rows = max(1, round(sum(s[0] for s in timeable) / max(1, len(timeable))))
    shape = replace(p, num_tokens=mean_rows)
    if rates.kind == "interpreter":
        layer_s = layer_programs(shape) * INTERP_PROGRAM_S
    else:
        layer_s = rates.seconds(*layer_call_work(shape), 30)
    shapes_s = 2 * timed * (SHAPE_BUILD_S[rates.kind] + SHAPE_CALLS[rates.kind] * layer_s)
    replay_calls = serving.trace_replay * plan["calls_per_step"]
    replay_s = 2 * replay_calls * (SHAPE_BUILD_S[rates.kind] + SHAPE_CALLS[rates.kind] * layer_s)
    ep_s = rank_seconds(p, plan, rates, timeable, mean_rows) if p.ep_size > 1 else 0.0
    host_s = (HOST_S_FIXED + plan["distinct_steps"] * (HOST_S_PER_STEP + max(1, p.ep_size) * HOST_S_PER_RANK_STEP)
              + plan["shapes"] * HOST_S_PER_SHAPE + routed_rows(p, plan) * ROUTE_S_PER_ROW[rates.kind])
    return shapes_s + replay_s + ep_s + host_s + (RUN_CALLS + CHECK_CALLS) * layer_s


def rank_seconds(p: Params, plan: dict, rates: DeviceRates, timeable: list, mean_rows: int, replay: bool = True
                 ) -> float:
    """The EP step's rank timings: the design at a rank's mean routes, the decisive rounds at the slowest rank's
    (the mean plus, where the padded rows are identical, every source's padding piled onto one rank), the
    replay's ranks at the mean (`replay`: the point replays trace_replay steps); the plan's seconds bound the
    design and rounds (plus one round's overrun)."""
    from moebench.bench.serving_trace.knobs import ServingKnobs
    from moebench.bench.serving_trace.plan import DESIGN_SHARE, ROUND

    serving = p.knobs(ServingKnobs)
    device = "cuda" if rates.is_cuda else "cpu"
    rows_max = plan["rows_max"][device]
    calls_per_mb = plan["calls_per_step"] / max(1, plan["micro_batches"])
    share = p.local_experts * p.top_k / p.num_experts
    mean_pad = sum(rows - real for rows, real in timeable) / max(1, len(timeable))
    sources = max(p.ep_size, serving.dp_size * serving.sp_size)
    pile = mean_pad * calls_per_mb * sources / max(1, serving.dp_size) if p.padding_fill in ("zeros", "repeat") \
        else mean_pad * calls_per_mb * share
    mean_routes = max(1, round(mean_rows * calls_per_mb * share))
    heavy_routes = max(mean_routes, round(HEAVY_RANK * mean_routes + pile / 2))  # the two sides' mean

    def timing_s(routes: int) -> float:
        routes = min(routes, rows_max) if rows_max else routes
        if rates.kind == "interpreter":
            programs = expert_programs(p, routes, p.local_experts)
            return RANK_BUILD_S + RANK_CALLS[rates.kind] * programs * INTERP_PROGRAM_S
        call_s = rates.seconds(*expected_expert_work(p, routes, p.local_experts), 12) / RANK_ROOF_SHARE
        # a long call's samples stop at SETTLED_SAMPLED_US of GPU time, after its untimed and mode-choosing calls
        return RANK_BUILD_S + min(RANK_CALLS[rates.kind] * call_s, 2 * call_s + SETTLED_SAMPLED_US * 1e-6)

    workloads = 2 * plan["distinct_steps"] * plan["micro_batches"] * p.ep_size
    budget = serving.rank_timings(device)
    timings = min(budget, workloads)
    design = timings if workloads <= budget else budget // DESIGN_SHARE
    plan_s = design * timing_s(mean_routes) + (timings - design) * timing_s(heavy_routes)
    seconds = serving.rank_seconds(device)
    if seconds is not None:
        plan_s = min(plan_s, max(design * timing_s(mean_routes), seconds) + ROUND * timing_s(heavy_routes))
    replay = serving.trace_replay * 2 * plan["micro_batches"] * p.ep_size if replay else 0
    # a launch config per power-of-two bucket of rows, from one row to the heaviest rank's
    compiles = heavy_routes.bit_length() * RANK_COMPILE_S if rates.is_cuda else 0.0
    return plan_s + replay * timing_s(mean_routes) + compiles
