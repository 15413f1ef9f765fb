"""Host-side pieces shared by the routers (topk_softmax, grouped_topk): argument checks, output buffers, the
references' stable selection and renormalisation, and the Triton routers' launch configuration and preamble."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moebench.kernels._details.args import check_mask
from moebench.kernels._details.jit import check_triton_device
from moebench.kernels._details.tuning import Choice, Tunable, choose, register_tunable

MAX_EXPERTS = 1024  # the Triton routers hold a whole row of scores in registers
MAX_TOP_K = 32
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_router_args(logits: torch.Tensor, top_k: int, is_padding: torch.Tensor | None,
                      bias: torch.Tensor | None) -> tuple[int, int]:
    """Validate the common router arguments; returns (num_tokens, num_experts)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, num_experts], got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    num_tokens, num_experts = logits.shape
    if num_experts < 1:
        raise ValueError("logits must have at least one expert column")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    check_mask(is_padding, num_tokens)
    if is_padding is not None:
        if is_padding.dtype != torch.bool:
            raise TypeError(f"is_padding must be a bool tensor, got {is_padding.dtype}")
        if is_padding.device != logits.device:
            raise ValueError(f"is_padding is on {is_padding.device}, logits on {logits.device}")
    if bias is not None:
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [{num_experts}], got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a float tensor, got {bias.dtype}")
        if bias.device != logits.device:
            raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    return num_tokens, num_experts


def check_triton_router_limits(num_experts: int, top_k: int) -> None:
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the Triton routers support num_experts <= {MAX_EXPERTS}, got {num_experts}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"the Triton routers support top_k <= {MAX_TOP_K}, got {top_k}")


def router_limits_problem(num_experts: int, top_k: int) -> str | None:
    """Impl.validate helper: why a point is impossible for the routers, or None."""
    if top_k > min(num_experts, MAX_TOP_K):
        return f"top_k: {top_k} > min(num_experts={num_experts}, {MAX_TOP_K})"
    if num_experts > MAX_EXPERTS:
        return f"num_experts: {num_experts} > {MAX_EXPERTS}"
    return None


def router_outputs(num_tokens: int, top_k: int, device: torch.device,
                   out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T,K], ids int32 [T,K]): the caller's buffers (checked) or new ones."""
    if out is None:
        return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
                torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))
    weights, ids = out
    for t, dtype, name in ((weights, torch.float32, "weights"), (ids, torch.int32, "ids")):
        if t.shape != (num_tokens, top_k) or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"out {name} must be a contiguous {dtype} [{num_tokens}, {top_k}] tensor on {device}")
    return weights, ids



def zero_non_finite_torch(scores: torch.Tensor) -> torch.Tensor:
    """The routers' clamp (docs/contracts.md "Routers", non-finite logits): a NaN or +-Inf score becomes +0.0.

    Applied to the activated scores (softmax / sigmoid), before the bias and the selection, as vLLM's routers do:
    a row that a NaN or +Inf logit turns into NaN scores then ranks on the bias alone (ties: lower index) and gets
    finite (zero) weights instead of NaN ones.
    """
    return torch.where(torch.isfinite(scores), scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


def select_desc_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, in descending order, ties to the lower index (int64 [T, k]).

    torch.topk does not promise which of equal values it returns; a stable descending sort keeps equal values in
    index order, which is exactly the tie rule.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def renormalize_torch(weights: torch.Tensor) -> torch.Tensor:
    """w / sum(w) over the selected slots; a row whose sum is 0 is left unchanged."""
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total == 0, weights, weights / total)


def mask_padded_rows_torch(weights: torch.Tensor, ids: torch.Tensor, is_padding: torch.Tensor | None) -> None:
    """Padded rows: ids -1 and weights 0.0 in every slot (in place)."""
    if is_padding is not None:
        ids.masked_fill_(is_padding[:, None], -1)
        weights.masked_fill_(is_padding[:, None], 0.0)


def write_out(weights: torch.Tensor, ids: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return weights, ids
    out[0].copy_(weights)
    out[1].copy_(ids)
    return out[0], out[1]


SELECTIONS = ("twopass", "packed64", "cand<M>")  # cand<M>: K + M candidates, M a positive integer


@dataclass(frozen=True)
class RouterConfig:
    """How the Triton routers pick and launch (outputs are the same under every config; only the speed differs).

    selection: "twopass" (per pick, a max of the int32 score keys, then the lowest expert holding it: two int32
    reductions), "packed64" (per pick, one max of int64 keys = score key << 32 | inverted expert index) or
    "cand<M>" (K + M candidates by coarse int32 keys from column-sorted levels, resolved exactly, verified, with
    the two-pass selection as the fallback; see topk_softmax's module docstring).
    elements_per_program: row elements per program (BLOCK_T = this // padded row width, at most 128 rows).
    elements_per_thread: row elements each thread holds (num_warps = the program's elements // (32 * this), at
    most 8).
    """

    selection: str = "twopass"
    elements_per_program: int = 4096
    elements_per_thread: int = 32

    @property
    def name(self) -> str:
        """"<selection>:<elements per program>:<elements per thread>" (a preset is named by its key instead)."""
        return f"{self.selection}:{self.elements_per_program}:{self.elements_per_thread}"

    @property
    def extra_candidates(self) -> int | None:
        """M of a "cand<M>" selection, else None."""
        return int(self.selection[4:]) if self.selection.startswith("cand") else None

    def launch(self, row_elements: int) -> tuple[int, int]:
        """(BLOCK_T, num_warps) for a tile whose rows hold `row_elements` (a power of two) elements."""
        block_t = max(1, min(128, self.elements_per_program // row_elements))
        num_warps = max(1, min(8, block_t * row_elements // (32 * self.elements_per_thread)))
        return block_t, num_warps


# The candidate table of both routers (`config:` of a sweep, `moebench tune sweeps/tune_router.yaml`; a launcher's
# `config=` also takes "<selection>:<elements per program>:<elements per thread>"). cand4 is the rule for both
# routers (each has its own tuned table entries); figures: docs/benchmarks.md#routers.
ROUTER_CONFIGS = {
    "twopass": RouterConfig("twopass", 4096, 32),  # 16 rows of 256 experts, 4 warps, 32 values per thread
    "packed64": RouterConfig("packed64", 4096, 32),
    "twopass-16": RouterConfig("twopass", 2048, 16),  # 8 rows of 256, 4 warps, half the registers per thread
    "packed64-16": RouterConfig("packed64", 2048, 16),
    # candidate selections: K + M coarse candidates (M = 2 falls back on ~0.4% of random bf16 softmax rows,
    # M = 4 on ~5e-6; see topk_softmax's module docstring). The 16-row program needs far more registers a thread
    # than the 8- and 4-row ones: occupancy for the trial.
    "cand2": RouterConfig("cand2", 4096, 32),
    "cand4": RouterConfig("cand4", 4096, 32),
    "cand8": RouterConfig("cand8", 4096, 32),
    "cand2-16": RouterConfig("cand2", 2048, 16),
    "cand4-16": RouterConfig("cand4", 2048, 16),  # 8 rows of 256, 4 warps
    "cand4-8": RouterConfig("cand4", 1024, 8),  # 4 rows of 256, 4 warps, one row per thread
}
DEFAULT_ROUTER_CONFIG = "cand4"  # the fastest selection for topk_softmax at T >= 8192 on the H200


def is_selection(name: str) -> bool:
    return name in SELECTIONS[:2] or (name.startswith("cand") and name[4:].isdigit() and int(name[4:]) > 0)


@functools.lru_cache(maxsize=64)
def parse_router_config(text: str) -> RouterConfig:
    """A preset name from ROUTER_CONFIGS, or "<selection>:<elements per program>:<elements per thread>"."""
    text = text.strip()
    if text in ROUTER_CONFIGS:
        return ROUTER_CONFIGS[text]
    parts = text.split(":")
    ok = len(parts) == 3 and is_selection(parts[0]) and all(p.isdigit() and int(p) > 0 for p in parts[1:])
    if not ok:
        raise ValueError(f"router config {text!r}: expected one of {', '.join(ROUTER_CONFIGS)} or "
                         f"'<{'|'.join(SELECTIONS)}>:<elements per program>:<elements per thread>'")
    return RouterConfig(parts[0], int(parts[1]), int(parts[2]))


def router_config(text: str) -> RouterConfig:
    """The config a name or "<selection>:<elements per program>:<elements per thread>" spec stands for."""
    return parse_router_config(text)


def register_router_tunable(kernel: str, bucket) -> None:
    """A router's tunable: the shared candidate table, its own bucket and tuned entries, DEFAULT_ROUTER_CONFIG as
    the rule."""
    register_tunable(Tunable(kernel, ROUTER_CONFIGS, bucket,
                             lambda **dims: (DEFAULT_ROUTER_CONFIG, ROUTER_CONFIGS[DEFAULT_ROUTER_CONFIG]),
                             f"{DEFAULT_ROUTER_CONFIG} at every shape"))


def router_choice(kernel: str, device, config: str | RouterConfig | None, **dims) -> Choice:
    """The launch of a Triton router (tuning.choose); `config` may also be a "<selection>:<per program>:<per
    thread>" spec outside the table (explicit). Default launch shape of the rule: about 4096 elements per program
    (16 rows of 256 experts, 4 of 1024), 32 fp32 values per thread with 4 warps, well inside the register file with
    x, the scores and the keys live at once, and enough programs at T=8192 (512) to fill 132 SMs."""
    if isinstance(config, str) and config not in ROUTER_CONFIGS and config != "auto":
        config = parse_router_config(config)
    return choose(kernel, device, config, **dims)


def triton_router_operands(logits: torch.Tensor, top_k: int, num_experts: int, is_padding: torch.Tensor | None,
                           bias: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor] | None):
    """The Triton routers' common launch preamble (arguments already checked): (logits, bias, weights, ids).

    Limits and device checked, outputs are the caller's buffers or new ones, and logits rows and the bias made
    unit-stride because the kernels address them as row_base + expert.
    """
    check_triton_router_limits(num_experts, top_k)
    check_triton_device(logits, is_padding, bias)
    weights, ids = router_outputs(logits.shape[0], top_k, logits.device, out)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return logits, bias, weights, ids
