"""Where padded rows come from (docs/contracts.md#padding-producers) and what they contain (the fill modes).

`is_padding` is a bool [T] mask, True = not a real token.

Producers (pure functions; the collective ones also take a torch.distributed group):
  cudagraph  `default_capture_sizes`, `cudagraph_padded_size`, `cudagraph_pad`
  dp         `dp_pad`            (pad to the max token count across DP ranks)
  sp         `sp_pad_and_chunk`  (pad to a multiple of the TP size, take this rank's chunk)
  pcp        `pcp_gather`        (rows and masks gathered rank-major across context-parallel ranks)
  dbo        `dbo_split`         (two micro-batches split at T_padded // 2, each with its mask slice)
  `producer_mask(p, device)` gives one rank's mask for a sweep point (see its docstring).
Rows a producer adds are zeros; what padded rows contain is chosen separately with `fill_rows`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moebench.kernels.contract import check_mask  # noqa: F401  (re-exported)
from moebench.params import Params, padding_rows
from moebench.traces.capture_lists import CAPTURE_LISTS, resolve_capture_sizes

FILLS = ("zeros", "repeat", "stale", "random")


def ratio_mask(num_tokens: int, padding_ratio: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `ratio` producer: the trailing round(T * ratio) rows are padding."""
    num_padding = padding_rows(num_tokens, padding_ratio)
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    if num_padding:
        mask[num_tokens - num_padding:] = True
    return mask


def fill_rows(rows: torch.Tensor, is_padding: torch.Tensor, fill: str, *, generator: torch.Generator,
              stale: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite the padded rows of `rows` ([T, D], in place) according to `fill` and return it.

    zeros:  all-zero rows.
    repeat: copies of the first real row (what padded input id 0 gives after embedding).
    stale:  rows left over from a previous batch (`stale`, same shape; drawn fresh when not given).
    random: fresh N(0, 1) rows.
    """
    if fill not in FILLS:
        raise ValueError(f"unknown padding fill {fill!r} (one of {', '.join(FILLS)})")
    check_mask(is_padding, rows.shape[0])
    idx = is_padding.nonzero().flatten()
    if idx.numel() == 0:
        return rows
    if fill == "zeros":
        rows[idx] = 0
    elif fill == "repeat":
        real = (~is_padding).nonzero().flatten()
        src = real[0] if real.numel() else idx[0]
        rows[idx] = rows[src].clone().unsqueeze(0).expand(idx.numel(), -1)  # clone: one padded row would alias
    elif fill == "stale":
        if stale is None:
            stale = torch.randn(rows.shape, generator=generator, device=rows.device, dtype=torch.float32)
        rows[idx] = stale[idx].to(rows.dtype)
    else:
        fresh = torch.randn((idx.numel(), rows.shape[1]), generator=generator, device=rows.device,
                            dtype=torch.float32)
        rows[idx] = fresh.to(rows.dtype)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Producers
# ---------------------------------------------------------------------------------------------------------------


def _pad_rows(x: torch.Tensor, total_rows: int, is_padding: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Append zero rows to `x` ([T, ...]) up to `total_rows`; the mask marks them True (and keeps `is_padding`).

    Returns `x` itself when no row is added (an eager batch is not copied).
    """
    num_rows = x.shape[0]
    check_mask(is_padding, num_rows)
    if total_rows < num_rows:
        raise ValueError(f"cannot pad {num_rows} rows down to {total_rows}")
    mask = torch.ones(total_rows, dtype=torch.bool, device=x.device)
    mask[:num_rows] = is_padding if is_padding is not None else False
    if total_rows == num_rows:
        return x, mask
    x_padded = x.new_zeros((total_rows, *x.shape[1:]))
    x_padded[:num_rows] = x
    return x_padded, mask


def default_capture_sizes() -> list[int]:
    """The common serving list of CUDA-graph capture sizes: 1, 2, 4, 8, then multiples of 8 up to 512."""
    return list(CAPTURE_LISTS["default"])


def cudagraph_padded_size(num_real: int, capture_sizes: Sequence[int] | str | None = None) -> int:
    """Rows the batch has once padded for CUDA-graph replay: the smallest capture size >= `num_real`.

    `capture_sizes`: the sizes, or a name of moebench.traces.capture_lists (None or empty: the default list).
    Above the largest capture size the batch runs eagerly, unpadded (returns `num_real`); 0 tokens stay 0.
    """
    if num_real < 0:
        raise ValueError(f"num_real must be >= 0, got {num_real}")
    sizes = resolve_capture_sizes(capture_sizes) if capture_sizes else default_capture_sizes()
    if num_real == 0:
        return 0
    for size in sizes:
        if size >= num_real:
            return int(size)
    return int(num_real)


def cudagraph_pad(x: torch.Tensor, capture_sizes: Sequence[int] | str | None = None, *,
                  is_padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the rows of `x` ([T, ...]) to the CUDA-graph capture size: (x_padded, is_padding [T_padded]).

    The tail rows are padding (zeros here; use `fill_rows` for another content). An incoming `is_padding` of the
    T rows is kept in front. Above the largest capture size nothing is added and `x` itself is returned.
    """
    return _pad_rows(x, cudagraph_padded_size(x.shape[0], capture_sizes), is_padding)


def _collective_device(group, like: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo (and the rest) take CPU tensors."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_pad(x: torch.Tensor, num_tokens_across_dp: Sequence[int] | None = None, *, group=None,
           is_padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DP padding: every data-parallel rank pads its rows to the max token count across the DP ranks.

    Give either `num_tokens_across_dp` (every DP rank's row count, this rank's included) or `group` (a
    torch.distributed group of the DP ranks: the max is an all_reduce MAX of the local counts, a host sync).
    Returns (x_padded, is_padding); added tail rows are zeros and marked True.
    """
    if (num_tokens_across_dp is None) == (group is None):
        raise ValueError("dp_pad: give exactly one of num_tokens_across_dp or group")
    num_local = x.shape[0]
    if group is not None:
        import torch.distributed as dist

        count = torch.tensor([num_local], dtype=torch.int64, device=_collective_device(group, x.device))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        max_tokens = int(count.item())
    else:
        counts = [int(n) for n in num_tokens_across_dp]
        if not counts or min(counts) < 0:
            raise ValueError(f"num_tokens_across_dp must be a non-empty list of counts >= 0, got {counts}")
        if num_local not in counts:
            raise ValueError(f"this rank's {num_local} rows are not among num_tokens_across_dp {counts}")
        max_tokens = max(counts)
    return _pad_rows(x, max_tokens, is_padding)


def sp_pad_and_chunk(x: torch.Tensor, is_padding: torch.Tensor | None, sp_size: int, sp_rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence parallelism: pad T up to a multiple of `sp_size` (the mask padded with True), then return
    SP (TP) rank `sp_rank`'s chunk of rows and of the mask (views of the padded batch, `T_padded // sp_size` rows).

    Padding (SP's and any already in `is_padding`, which lives at the tail) lands in the last ranks' chunks.
    """
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_pad_and_chunk: need sp_size >= 1 and 0 <= sp_rank < sp_size, got {sp_size}, {sp_rank}")
    num_rows = x.shape[0]
    padded_rows = -(-num_rows // sp_size) * sp_size
    x_padded, mask = _pad_rows(x, padded_rows, is_padding)
    chunk = padded_rows // sp_size
    rows = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return x_padded[rows], mask[rows]


def pcp_gather(x_local: torch.Tensor, mask_local: torch.Tensor | None, group=None,
               peers: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context parallelism: gather rows and masks across the P ranks in rank-major order.

    Every rank holds N rows. Returns (x [P*N, ...], is_padding [P*N]): the gathered mask has exactly P*N
    entries and row i of it belongs to gathered row i (rank r's rows at [r*N, (r+1)*N)). The rank-local mask
    (N entries) is NOT a mask for the gathered rows: a consumer given it raises the size-mismatch error
    (docs/contracts.md#padding-contract).
    - `group`: a torch.distributed group of the P ranks (all_gather; a None mask counts as all real).
    - `peers`: without a group, every rank's (x, mask) in rank order, this rank's included (stands in for the
      collective); each must have x_local's row count and row shape.
    - neither: P = 1, the local rows and mask (all False when None).
    """
    if group is not None and peers is not None:
        raise ValueError("pcp_gather: give group or peers, not both")
    num_local = x_local.shape[0]
    check_mask(mask_local, num_local)
    if group is None:
        pairs = list(peers) if peers is not None else [(x_local, mask_local)]
        if not pairs:
            raise ValueError("pcp_gather: peers is empty")
        for rank, (x_r, mask_r) in enumerate(pairs):
            if x_r.shape != x_local.shape:
                raise ValueError(f"pcp_gather: rank {rank} has rows of shape {tuple(x_r.shape)}, "
                                 f"expected {tuple(x_local.shape)} (every rank holds N rows)")
            check_mask(mask_r, num_local)
        masks = [m.to(device=x_local.device, dtype=torch.bool) if m is not None
                 else torch.zeros(num_local, dtype=torch.bool, device=x_local.device) for _, m in pairs]
        return torch.cat([x_r.to(x_local.device) for x_r, _ in pairs]), torch.cat(masks)

    import torch.distributed as dist

    world = dist.get_world_size(group)
    dev = _collective_device(group, x_local.device)
    # Unequal row counts would make all_gather fail or hang: compare them first (every rank sees the same counts).
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([num_local], dtype=torch.int64, device=dev), group=group)
    counts_l = [int(c.item()) for c in counts]
    if len(set(counts_l)) != 1:
        raise ValueError(f"pcp_gather: every rank must hold the same number of rows, got {counts_l}")
    x_send = x_local.to(dev).contiguous()
    x_parts = [torch.empty_like(x_send) for _ in range(world)]
    dist.all_gather(x_parts, x_send, group=group)
    # Masks travel as uint8: not every backend reduces/gathers bool tensors.
    m_send = (mask_local if mask_local is not None else torch.zeros(num_local, dtype=torch.bool)).to(
        device=dev, dtype=torch.uint8).contiguous()
    m_parts = [torch.empty_like(m_send) for _ in range(world)]
    dist.all_gather(m_parts, m_send, group=group)
    return (torch.cat(x_parts).to(x_local.device),
            torch.cat(m_parts).to(device=x_local.device, dtype=torch.bool))


def dbo_split(x: torch.Tensor, is_padding: torch.Tensor | None
              ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """Dual-batch overlap: two micro-batches split at T_padded // 2, each with its own slice of the mask.

    Returns ((x[:h], mask[:h]), (x[h:], mask[h:])) with h = T // 2 (views; masks None when `is_padding` is).
    Tail padding therefore lands in the second micro-batch.
    """
    num_rows = x.shape[0]
    check_mask(is_padding, num_rows)
    half = num_rows // 2
    m0 = is_padding[:half] if is_padding is not None else None
    m1 = is_padding[half:] if is_padding is not None else None
    return (x[:half], m0), (x[half:], m1)


def pcp_rank_masks(rows_per_rank: int, num_ranks: int, padding_ratio: float,
                    device: torch.device | str) -> list[torch.Tensor]:
    """Per-rank masks of a context-parallel batch: round(P*N*ratio) padded rows overall, the real rows spread as
    evenly as possible (lower ranks take the remainder), each rank's padding at its own tail."""
    total = rows_per_rank * num_ranks
    num_real = total - padding_rows(total, padding_ratio)
    masks = []
    for rank in range(num_ranks):
        real_r = num_real // num_ranks + (1 if rank < num_real % num_ranks else 0)
        m = torch.ones(rows_per_rank, dtype=torch.bool, device=device)
        m[:real_r] = False
        masks.append(m)
    return masks


def producer_mask(p: Params, device: torch.device | str = "cpu") -> torch.Tensor:
    """The bool mask one rank sees at a sweep point, made by running the point's producer (ranks simulated)."""
    return run_producer(p, device)[0]


def run_producer(p: Params, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(is_padding, before) at a sweep point: the mask one rank sees after running the point's producer (ranks
    simulated), and the mask that rank held before the producer's gather or split: pcp: this rank's own N-entry
    mask; dbo: the full batch's mask. For the other producers `before` is is_padding. moebench.inputs.router_mask
    picks from the two what the router is handed.

    Its length is the rows the routed kernels then process; padding_ratio and producer_size mean:
    - ratio:     num_tokens rows, the trailing round(num_tokens * padding_ratio) are padding.
    - cudagraph: num_tokens REAL tokens padded to the smallest capture size >= num_tokens (p.capture_sizes or
                 `default_capture_sizes()`); above the largest, no padding (eager). padding_ratio is unused:
                 the capture sizes decide the padding.
    - dp:        this DP rank holds num_tokens - round(num_tokens * padding_ratio) real tokens; the other
                 producer_size - 1 DP ranks hold num_tokens (the busiest rank), so this rank is padded at the tail
                 to num_tokens rows. With producer_size == 1 there is no DP padding (all real).
    - sp:        the TP group's replicated batch has num_tokens rows whose trailing round(num_tokens *
                 padding_ratio) are already padding (upstream cudagraph/DP padding); SP pads it to a multiple of
                 producer_size (TP size) and this is the LAST TP rank's chunk, ceil(num_tokens / producer_size)
                 rows: the chunk where the tail padding lands (the first ranks' chunks are all real until the
                 padding reaches them).
    - pcp:       each of the producer_size PCP ranks holds num_tokens rows; round(P * num_tokens * padding_ratio)
                 of the P * num_tokens rows are padding, the real tokens spread evenly over the ranks (lower ranks
                 take the remainder), each rank's padding at its own tail; the mask is the rank-major GATHERED
                 mask of P * num_tokens entries (what the router sees after the PCP all-gather).
    - dbo:       num_tokens rows with round(num_tokens * padding_ratio) tail padding, split at num_tokens // 2;
                 this is the SECOND micro-batch's mask (num_tokens - num_tokens // 2 rows), where the tail
                 padding lands.
    """
    device = torch.device(device)
    producer = p.padding_producer
    n = p.num_tokens

    def rows(count: int) -> torch.Tensor:  # zero-width rows: only the masks are computed
        return torch.empty((count, 0), device=device)

    if producer == "ratio":
        mask = ratio_mask(n, p.padding_ratio, device)
        return mask, mask
    if producer == "cudagraph":
        _, mask = cudagraph_pad(rows(n), p.capture_sizes)
        return mask, mask
    if producer == "dp":
        num_real = n - p.num_padding
        _, mask = dp_pad(rows(num_real), [num_real] + [n] * (p.producer_size - 1))
        return mask, mask
    if producer == "sp":
        upstream = ratio_mask(n, p.padding_ratio, device)
        _, mask = sp_pad_and_chunk(rows(n), upstream, p.producer_size, p.producer_size - 1)
        mask = mask.clone()
        return mask, mask
    if producer == "pcp":
        masks = pcp_rank_masks(n, p.producer_size, p.padding_ratio, device)
        peers = [(rows(n), m) for m in masks]
        _, mask = pcp_gather(peers[0][0], peers[0][1], peers=peers)
        return mask, masks[0]
    if producer == "dbo":
        full = ratio_mask(n, p.padding_ratio, device)
        _, (_, mask_second) = dbo_split(rows(n), full)
        return mask_second.clone(), full
    raise ValueError(f"unknown padding producer {producer!r}")
