"""What work costs before it runs: the FLOPs and bytes of the MoE stages, a family's declaration of what one of its
points does (`PointWork`, declared beside its impls with `moebench.registry.declare_work`), and the rates of a
device that turn work into seconds (`DeviceRates`). moebench.run.estimate adds them up into a run's estimate.

A GPU's rates are its roofs (moebench.measure.roofline) with at least a launch latency per kernel; a CPU's are the
Triton interpreter's (Python per program instance, numpy for the arithmetic) for Triton kernels and eager torch's for
torch code: constants measured on the project's 2-core CPU machines, good to the factor of two that decides
"seconds, minutes or hours" (tests/run/test_estimate_vs_wall.py holds every bundled sweep to it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from moebench.kernels.masked_moe_sum import SumLaunch, sum_grid, sum_launch_config
from moebench.measure.roofline import Roofs, roofline_us

if TYPE_CHECKING:  # pragma: no cover
    from moebench.params import Params

GPU_LAUNCH_S = 5e-6  # one kernel launch, eager
GPU_POINT_OVERHEAD_S = 1.0  # build, reference check, CUDA-graph capture of one point
CPU_POINT_OVERHEAD_S = 0.1  # build, check and record of one point in the point worker
INTERP_LAUNCH_S = 0.02  # one Triton launch in the interpreter, for a family that declares no interpreter time
INTERP_PROGRAM_S = 1e-3  # one program-equivalent in the interpreter: a program instance's few dozen tl ops
INTERP_FLOPS = 2e9  # tl.dot in the interpreter (numpy)
INTERP_BYTES_PER_S = 2e8  # loads and stores in the interpreter
CPU_CALL_S = 1e-3  # one eager torch call on a shared 2-core CPU (its Python dispatch included)
CPU_FLOPS = 2e10
CPU_BYTES_PER_S = 2e9
GPU_COMPILE_S = 5.0  # one torch.compile'd function (dynamo, inductor, Triton codegen), cold
CPU_COMPILE_S = 2.5  # one torch.compile'd function on the CPU (inductor's C++ compile; its on-disk cache helps)
STEP_INPUTS_S = 0.005  # one step of a trace built and routed on the host (inputs.make_batch + route)
TRITON_COMPILE_S = 0.4  # one Triton kernel variant compiled on a GPU


@dataclass(frozen=True)
class DeviceRates:
    """How fast a device does work: `kind` is "cuda" (roofs given), "interpreter" (Triton kernels on a CPU) or
    "cpu" (torch code on a CPU)."""

    kind: str
    roofs: Roofs | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def point_overhead_s(self) -> float:
        return GPU_POINT_OVERHEAD_S if self.is_cuda else CPU_POINT_OVERHEAD_S

    def seconds(self, flops: float, nbytes: float, launches: float) -> float:
        """Seconds of `flops` FLOPs and `nbytes` bytes in `launches` launch-equivalents."""
        if self.is_cuda:
            return max(roofline_us(int(flops), int(nbytes), self.roofs) * 1e-6, launches * GPU_LAUNCH_S)
        if self.kind == "interpreter":
            return launches * INTERP_LAUNCH_S + flops / INTERP_FLOPS + nbytes / INTERP_BYTES_PER_S
        return launches * CPU_CALL_S + flops / CPU_FLOPS + nbytes / CPU_BYTES_PER_S

    @property
    def compile_s(self) -> float:
        """One torch.compile'd function compiled afresh."""
        return GPU_COMPILE_S if self.is_cuda else CPU_COMPILE_S

    def torch_side(self) -> "DeviceRates":
        """The rates of the torch code beside the kernels (a reference, a host loop): the CPU's in the interpreter."""
        return DeviceRates("cpu") if self.kind == "interpreter" else self


@dataclass(frozen=True)
class PointWork:
    """What one point of a family does, declared once per family (moebench.registry.declare_work).

    A family whose point is one call timed many times declares that call: `call(p) -> (FLOPs, bytes)`, its kernel
    launches in launch-equivalents (`launches`, a number or a function of p: a GEMM's grid counts several), its cost
    in Triton's CPU interpreter (`programs(p)`: program-equivalents of INTERP_PROGRAM_S, its grids' program
    instances weighted by their loops: the interpreter runs each instance in Python), the variants whose code is
    torch rather than Triton (`torch_variants`, besides the family's reference and outside libraries: eager torch
    rates on a CPU), the stages it also times one by one (`stages_alone`, the layer's), and what building the point
    costs beyond the usual (`build(p, rates) -> seconds`: a trace replayed step by step before the timed call). A
    family whose point is not one call timed many times (a trace's shapes timed one by one) declares
    `point(p, rates) -> seconds` for the whole point instead.
    """

    call: Callable[["Params"], tuple[float, float]] | None = None
    launches: float | Callable[["Params"], float] = 1.0
    programs: Callable[["Params"], float] | None = None
    torch_variants: tuple[str, ...] = ()
    stages_alone: int = 0
    build: Callable[["Params", DeviceRates], float] | None = None
    point: Callable[["Params", DeviceRates], float] | None = None

    def __post_init__(self):
        if (self.call is None) == (self.point is None):
            raise ValueError("PointWork declares either the work of one call (call=) or the whole point (point=)")

    def with_compiles(self, functions: int) -> "PointWork":
        """The same work built with `functions` torch.compile'd functions compiled afresh per point (a peer)."""
        before = self.build

        def build(p: "Params", rates: DeviceRates) -> float:
            return functions * rates.compile_s + (before(p, rates) if before is not None else 0.0)
        return replace(self, build=build)

    def launches_of(self, p: "Params") -> float:
        return float(self.launches(p)) if callable(self.launches) else float(self.launches)

    def call_s(self, p: "Params", rates: DeviceRates) -> float:
        """Seconds of one call at `rates`."""
        flops, nbytes = self.call(p)
        if rates.kind == "interpreter" and self.programs is not None:
            return self.programs(p) * INTERP_PROGRAM_S + flops / INTERP_FLOPS + nbytes / INTERP_BYTES_PER_S
        return rates.seconds(flops, nbytes, self.launches_of(p))


# The work of the MoE stages, shared by the families that run them.

def router_work(p: "Params") -> tuple[float, float]:
    """A router over [T, E] logits: softmax and top-k selection, ids and weights written."""
    T, K, E = p.num_tokens, p.top_k, p.num_experts
    return 10.0 * T * E, T * E * 4.0 + T * K * 8.0


def id_work(p: "Params") -> tuple[float, float]:
    """A pass over the [T, K] expert ids (remap, globalize, align)."""
    return 0.0, p.num_tokens * p.top_k * 16.0


def expected_expert_work(p: "Params", rows: int, local_experts: int) -> tuple[float, float]:
    """The grouped expert GEMMs (gate, up, down) over `rows` rows with `local_experts` experts here."""
    routes = rows * p.top_k * local_experts / p.num_experts
    weight_bytes = 1 if p.expert_dtype == "fp8" else 2
    flops = 2.0 * routes * 3 * p.hidden * p.intermediate
    nbytes = (min(local_experts, routes) * 3 * p.hidden * p.intermediate * weight_bytes
              + routes * (2 * p.intermediate + p.hidden) * 2)
    return flops, nbytes + rows * p.hidden * 4


def layer_call_work(p: "Params") -> tuple[float, float]:
    """One MoE layer call: route, stage, map, align, the grouped GEMMs and the sum."""
    gemm_flops, gemm_bytes = expected_expert_work(p, p.num_tokens, p.local_experts)
    route_flops, route_bytes = router_work(p)
    T, K, H = p.num_tokens, p.top_k, p.hidden
    return gemm_flops + route_flops, gemm_bytes + route_bytes + T * H * 3.0 + T * K * (H * 2.0 + 32)


# Program-equivalents in the interpreter (INTERP_PROGRAM_S each), fitted on the project's 2-core CPU machines at the
# bundled sweeps' CPU sizes.

def router_programs(p: "Params") -> float:
    """A row block per program, the top-k picks looping over the experts: refitted on `moebench run` timings of
    topk_softmax (16 to 1024 rows, E * top_k 64 to 2048), where a row costs 1.5 to 2.6 program-equivalents."""
    return 8 + p.num_tokens * (1.5 + p.num_experts * p.top_k / 1850)


def expert_programs(p: "Params", rows: int, local_experts: int) -> float:
    """The grouped GEMMs: a tile per (row block, column block) of each local expert, looping over the hidden size,
    and more row blocks as the routes grow."""
    width = p.hidden + p.intermediate
    return 60 + 5 * local_experts + rows * p.top_k * local_experts / p.num_experts * width / 64


# moe_align_block_size's scatter sorts its block of routes (tl.sort, at least MIN_SORT_ROUTES a block), and the
# interpreter evaluates the sort's xor reductions one element at a time in Python: in `moebench run` that is most of
# an alignment (tests/_site/sitecustomize.py makes those reductions numpy for the test suite only, which the
# per-route figure below does not assume)
SORT_PROGRAMS_PER_ROUTE = 0.6
MIN_SORT_ROUTES = 128


def align_programs(routes: int) -> float:
    """moe_align_block_size over `routes` routes: count, scan and scatter launches, and the scatter's sort."""
    return 25 + routes / 8 + SORT_PROGRAMS_PER_ROUTE * max(routes, MIN_SORT_ROUTES)


# masked_moe_sum's kernel in the interpreter, per program: its ids and store, and a load and add per slot; a program
# whose rows are all padding checks its ids and stores zeros. Timed one call at a time (16 and 32 rows, top_k 1 to 8,
# hidden 64 to 7168, padding 0 and 0.5) against tests/run/machine_speed.py: within 20% a call whatever the
# block's width (64 to 1024 columns), so the grid's column blocks count in full.
SUM_PROGRAM = 2.5
SUM_SLOT = 0.75
PADDED_SUM_PROGRAM = 2.0


def slot_sum_programs(p: "Params", rows: int, launch: SumLaunch, padded_rows: int = 0) -> float:
    """The sum over the top_k slots of `rows` rows (masked_moe_sum's kernel) launched as `launch`: a program per
    row block and column block of the hidden size; the trailing `padded_rows` (slots all -1) load nothing."""
    row_blocks, col_blocks = sum_grid(rows, p.hidden, launch)
    padded_blocks = min(row_blocks, padded_rows // launch.rows)
    return col_blocks * ((row_blocks - padded_blocks) * (SUM_PROGRAM + SUM_SLOT * p.top_k)
                         + padded_blocks * PADDED_SUM_PROGRAM)


def fused_experts_programs(p: "Params", rows: int, local_experts: int, reduce_block_h: int) -> float:
    """One fused_experts call over `rows` rows: the alignment of their routes, the grouped GEMMs, the slot sum
    (kernels.masked_moe_sum.sum_slots asked for `reduce_block_h` columns, its config's reduce_block_h)."""
    sum_launch = sum_launch_config(p.hidden, reduce_block_h, top_k=p.top_k)  # as sum_slots launches
    return (align_programs(rows * p.top_k) + expert_programs(p, rows, local_experts)
            + slot_sum_programs(p, rows, sum_launch))


def layer_programs(p: "Params") -> float:
    """Route, stage and map, align, the experts, the sum."""
    return (router_programs(p) + 5 + align_programs(p.num_tokens * p.top_k)
            + expert_programs(p, p.num_tokens, p.local_experts) + 4 * p.num_tokens)
