"""Process groups for multi-rank points: start-up from a torchrun environment or self-spawn, per-rank seeds,
rank-0 printing and the per-iteration max over ranks.

`spawn(fn, world_size)` starts one process per rank (spawn start method; one GPU each with NCCL, or CPU ranks with
gloo) and calls `fn(ctx, *args)` in each, `ctx` being a `registry.RunContext`. A rank that raises, or dies, ends
the whole run: the parent terminates the other ranks and raises `SpawnError` naming the rank and the exception's
last line. Nothing hangs: collectives carry a process-group timeout and the parent has an overall deadline.
Nothing outlives the parent: each rank arms a parent-death signal (Linux prctl PR_SET_PDEATHSIG, SIGKILL) and a
watchdog thread that exits when the parent pid changes, so a killed runner leaves no rank appending records.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from moebench.registry import RunContext

# Multicast / NVLS paths are off on the lent multi-GPU machines (docs/hardware.md#nccl); spawned ranks inherit these defaults.
ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

DEFAULT_PG_TIMEOUT_S = 300.0


class SpawnError(RuntimeError):
    """A spawned rank failed (raised, died or timed out). `rank` is the first rank that failed (None: timeout)."""

    def __init__(self, message: str, rank: int | None = None, child_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback


# ---------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------

def apply_env_defaults() -> None:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible seed per rank (same mixing as inputs.make_batch's seed_offset)."""
    return seed * 1_000_003 + rank


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rank(group: Any = None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def print0(*args: Any, group: Any = None, **kwargs: Any) -> None:
    """print() on rank 0 only (every rank when no process group is up)."""
    if get_rank(group) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def comm_device(group: Any = None) -> torch.device:
    """Where tensors for collectives on `group` must live: the current GPU for NCCL, the CPU otherwise."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exception_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1].strip()}" if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------------------------
# Per-iteration max over ranks
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class RankMax:
    """Timing samples reduced over ranks."""

    per_iter_max: list[float]  # max over ranks of sample i
    per_iter_argmax: list[int]  # the (lowest) rank attaining it
    slowest_rank: int  # the rank that attains the max most often (ties: lower rank)
    argmax_counts: list[int] = field(default_factory=list)  # per rank: how many iterations it was the slowest


def max_over_ranks(samples: Sequence[float], group: Any = None) -> RankMax:
    """Per-iteration max over the ranks of `group` (all_reduce MAX), the rank attaining it, and the slowest rank.

    Every rank must pass the same number of samples (call it after the same number of timed iterations).
    """
    import torch.distributed as dist

    n = len(samples)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return RankMax(list(map(float, samples)), [0] * n, 0, [n])
    dev = comm_device(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    count = torch.tensor([n, -n], dtype=torch.int64, device=dev)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count[0]) != n or int(-count[1]) != n:
        raise ValueError(f"max_over_ranks: ranks passed different sample counts "
                         f"(between {int(-count[1])} and {int(count[0])})")
    mine = torch.tensor(list(samples), dtype=torch.float64, device=dev)
    top = mine.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # The lowest rank whose sample equals the max: MIN over (rank if mine == max else world).
    who = torch.where(mine == top, torch.full_like(mine, rank, dtype=torch.int64),
                      torch.full_like(mine, world, dtype=torch.int64))
    dist.all_reduce(who, op=dist.ReduceOp.MIN, group=group)
    argmax = [int(r) for r in who.cpu().tolist()]
    counts = [0] * world
    for r in argmax:
        counts[r] += 1
    slowest = max(range(world), key=lambda r: (counts[r], -r))
    return RankMax([float(v) for v in top.cpu().tolist()], argmax, slowest, counts)


# ---------------------------------------------------------------------------------------------------------------
# Start-up from a torchrun environment
# ---------------------------------------------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        if torch.cuda.device_count() <= local_rank:
            raise RuntimeError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_group(backend: str, rank: int, world_size: int, device: torch.device, init_method: str,
                pg_timeout_s: float) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator to this GPU (eager init, no device guessing)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s), **kwargs)


def init_from_env(backend: str | None = None, pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S) -> RunContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Idempotent: when a default group already exists it is reused.
    """
    import torch.distributed as dist

    apply_env_defaults()
    backend = backend or default_backend()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = _device_for(backend, local_rank)
    if not dist.is_initialized():
        _init_group(backend, rank, world_size, device, "env://", pg_timeout_s)
    return RunContext(device=device, rank=dist.get_rank(), world_size=dist.get_world_size(), group=dist.group.WORLD)


# ---------------------------------------------------------------------------------------------------------------
# Self-spawn
# ---------------------------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_PERIOD_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (its parent) ends: the kernel's parent-death signal where there is one,
    and a watchdog polling os.getppid() (reparenting changes it) everywhere, which also covers a parent that
    died before the signal was armed."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl: the watchdog alone
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(WATCHDOG_PERIOD_S)

    threading.Thread(target=watch, name="moebench-parent-watchdog", daemon=True).start()


def _child_main(rank: int, world_size: int, backend: str, port: int, fn: Callable, args: tuple, conn: Any,
                pg_timeout_s: float, env: dict[str, str], parent_pid: int | None = None) -> None:
    """Body of one spawned rank. Reports ("ok", result) or ("error", line, traceback, time) through `conn`."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    apply_env_defaults()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as dist

    try:
        device = _device_for(backend, rank)
        _init_group(backend, rank, world_size, device, f"tcp://127.0.0.1:{port}", pg_timeout_s)
        ctx = RunContext(device=device, rank=rank, world_size=world_size, group=dist.group.WORLD)
        result = fn(ctx, *args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        sys.stderr.write(f"[moebench rank {rank}] {tb}")
        sys.stderr.flush()
        try:
            conn.send(("error", _exception_line(e), tb, time.time()))
        finally:
            # Skip interpreter teardown: a group with a dead peer can block in its destructor.
            os._exit(1)
    conn.close()
    try:
        dist.barrier()  # nobody tears down while a peer still runs its last collective
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - teardown after success is best effort
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is delivered; skipping interpreter teardown saves seconds per rank


_FALLOUT_MARKERS = ("closed by peer", "reset by peer", "remote worker", "communicator was aborted",
                    "Connection refused", "Broken pipe")


def is_peer_fallout(line: str) -> bool:
    """The error a rank sees when a peer of its group died (its own work was fine)."""
    return any(m.lower() in line.lower() for m in _FALLOUT_MARKERS)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


def spawn(fn: Callable[..., Any], world_size: int, backend: str | None = None, args: tuple = (),
          timeout_s: float | None = 1800.0, pg_timeout_s: float | None = None,
          on_wait: Callable[[], None] | None = None) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` spawned ranks and return the per-rank results (rank order).

    `fn` and `args` must be picklable (a module-level function). `timeout_s` bounds the whole run (None: no bound,
    collectives still time out after `pg_timeout_s`, default min(timeout_s, 300 s)). On the first failure the
    other ranks are terminated and `SpawnError` is raised: "rank R of W failed: <ExceptionType: last line>".
    `on_wait()` is called about once a second while the ranks run (the runner prints finished rows from it).
    Any exception here (KeyboardInterrupt included) stops the ranks before it propagates.
    """
    import multiprocessing.connection as mpc

    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"spawn: {world_size} NCCL ranks need {world_size} GPUs, "
                           f"{torch.cuda.device_count()} visible")
    if pg_timeout_s is None:
        pg_timeout_s = min(timeout_s, DEFAULT_PG_TIMEOUT_S) if timeout_s else DEFAULT_PG_TIMEOUT_S
    # Children inherit os.environ at start, so TRITON_INTERPRET (read when triton is first imported, which happens
    # while the child unpickles `fn`) is already there; the NCCL/NVSHMEM defaults only need to precede init.
    env = {k: os.environ.get(k, v) for k, v in ENV_DEFAULTS.items()}

    mpctx = mp.get_context("spawn")
    port = free_port()
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = mpctx.Pipe(duplex=False)
            p = mpctx.Process(target=_child_main, name=f"moebench-rank{rank}", daemon=True,
                              args=(rank, world_size, backend, port, fn, args, writer, pg_timeout_s, env,
                                    os.getpid()))
            p.start()
            writer.close()  # the parent keeps only the read end, so a dead child shows as EOF
            procs.append(p)
            readers.append(reader)
    except BaseException:
        _stop(procs)
        raise

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str, float]] = {}
    pending = set(range(world_size))
    first_error_at: float | None = None

    def collect(rank: int) -> bool:
        """Read rank's report if one is there; True when the rank is settled (reported or dead)."""
        closed = False
        if readers[rank].poll():
            try:
                msg = readers[rank].recv()
            except (EOFError, OSError):
                msg, closed = None, True  # the child's end closed without a report: it died
            if msg is not None and msg[0] == "ok":
                results[rank] = msg[1]
                return True
            if msg is not None:
                errors[rank] = (msg[1], msg[2], msg[3])
                return True
        if not closed and procs[rank].is_alive():
            return False
        if not closed and readers[rank].poll():  # it reported just before exiting
            return collect(rank)
        procs[rank].join(2.0)
        code = procs[rank].exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and \
            -code in signal.valid_signals() else f"exited with code {code}"
        errors[rank] = (f"{how} without reporting", "", time.time())
        return True

    try:
        while pending:
            now = time.monotonic()
            if first_error_at is not None and (now - first_error_at > 1.0 or not pending):
                break  # a short grace period lets the root cause's report arrive before its peers' fallout
            if deadline is not None and now > deadline:
                running = sorted(pending)
                _stop(procs)
                raise SpawnError(f"spawn: timed out after {timeout_s:g} s; ranks still running: {running}")
            wait_s = 0.2 if first_error_at is not None else 1.0
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - now))
            mpc.wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=wait_s)
            if on_wait is not None:
                on_wait()
            for r in sorted(pending):
                if collect(r):
                    pending.discard(r)
            if errors and first_error_at is None:
                first_error_at = time.monotonic()
        if errors:
            _stop(procs)
            # The root cause is the earliest failure that is not a peer's fallout (a broken connection to the
            # rank that failed first); a rank that died silently is only noticed late, hence the two keys.
            rank = min(errors, key=lambda r: (is_peer_fallout(errors[r][0]), errors[r][2], r))
            line, tb, _ = errors[rank]
            others = sorted(r for r in errors if r != rank)
            also = f" (also failed afterwards: ranks {others})" if others else ""
            raise SpawnError(f"rank {rank} of {world_size} failed: {line}{also}", rank=rank, child_traceback=tb)
        for p in procs:
            p.join(30.0)
        _stop(procs)  # a rank stuck in teardown after reporting success
        return [results[r] for r in range(world_size)]
    finally:
        for rd in readers:
            rd.close()
        if any(p.is_alive() for p in procs):
            _stop(procs)


def run_in_world(fn: Callable[..., Any], world_size: int, device_type: str = "cuda", args: tuple = (),
                 timeout_s: float | None = None, pg_timeout_s: float | None = None,
                 on_wait: Callable[[], None] | None = None) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` ranks: in the current group when this process already belongs to one
    of that size (torchrun), else spawned (`on_wait` as in `spawn`; unused in a group). Returns the per-rank
    results (under torchrun: this rank's only)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"run_in_world: needs {world_size} ranks, the current group has "
                             f"{dist.get_world_size()}")
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        return [fn(RunContext(device=dev, rank=dist.get_rank(), world_size=world_size, group=dist.group.WORLD),
                   *args)]
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"run_in_world: needs {world_size} ranks, torchrun started "
                             f"{os.environ['WORLD_SIZE']}")
        ctx = init_from_env(backend, pg_timeout_s or DEFAULT_PG_TIMEOUT_S)
        return [fn(ctx, *args)]
    return spawn(fn, world_size, backend=backend, args=args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                 on_wait=on_wait)
