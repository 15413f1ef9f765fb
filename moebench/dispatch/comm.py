"""What the dispatch paths use to move data: collectives that degenerate to copies on one rank (ep_size 1 needs no
process group), a side stream for small work beside the main stream's, buffers that only grow, and the choice
between the Triton kernels and their torch references."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from moebench.kernels.runtime import interpreting

GROW_ROWS = 256  # a growing buffer is rounded up to this many rows, so slightly larger steps reuse it


def triton_default(device: torch.device) -> bool:
    """The paths' default: the Triton kernels on a GPU or under the interpreter, the torch references otherwise."""
    return device.type == "cuda" or interpreting()


# ---------------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    return dist


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                      in_splits: list[int] | None = None, group: Any = None, world_size: int = 1) -> None:
    if world_size == 1:
        out.copy_(inp)
        return
    _dist().all_to_all_single(out, inp, out_splits, in_splits, group=group)


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: Any = None, world_size: int = 1) -> None:
    """out [R*T, ...] = cat over ranks of inp [T, ...] (rank order)."""
    if world_size == 1:
        out.copy_(inp)
        return
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name where it exists
    fn(out, inp, group=group)


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group: Any = None, world_size: int = 1) -> None:
    """out [T, ...] = sum over ranks of their inp [R*T, ...] rows [rank*T, (rank+1)*T)."""
    if world_size == 1:
        out.copy_(inp)
        return
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def max_over_ranks(value: torch.Tensor, group: Any = None, world_size: int = 1) -> int:
    """The max over ranks of a one-element integer tensor (all_reduce MAX; a host sync, for set-up only). On the
    device the group's backend needs (nccl: the current GPU, else the CPU)."""
    if world_size > 1:
        dist = _dist()
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        value = value.to(dev)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


# ---------------------------------------------------------------------------------------------------------------
# Steady-state helpers: buffers that only grow, a side stream
# ---------------------------------------------------------------------------------------------------------------

def grow_rows(buf: torch.Tensor | None, rows: int, make) -> torch.Tensor:
    """`buf` when it has at least `rows` rows, else `make(n)` with n >= rows (allocation happens on the first
    step of a size only, i.e. in warm-up)."""
    if buf is not None and buf.shape[0] >= rows:
        return buf
    return make(max(GROW_ROWS, -(-rows // GROW_ROWS) * GROW_ROWS))


class SideStream:
    """A second CUDA stream for small work that should overlap the main stream's (the count exchange beside the
    permutation). `fork_here()` right after the work the side job needs, then more main-stream work, then
    `with side.run():` the side job, and `join()` before main-stream work that needs its result. In stream order
    instead on a CPU and while a CUDA graph is being captured."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self._forked = torch.cuda.Event() if cuda else None
        self._main = None

    def fork_here(self) -> None:
        if self.stream is None or torch.cuda.is_current_stream_capturing():
            self._main = None
            return
        self._main = torch.cuda.current_stream(self.stream.device)
        self._forked.record(self._main)

    @contextmanager
    def run(self) -> Iterator[None]:
        if self._main is None:
            yield
            return
        self.stream.wait_event(self._forked)  # only what the main stream had at fork_here()
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self.stream)
            self._main = None
