"""Test-suite only: one pool of gloo ranks per test process (the `gloo_ranks` session fixture of conftest.py),
reused by every test that needs real collectives on a few CPU ranks, instead of a spawn per module or test (each
spawned rank costs an interpreter start: about 2.5 s of CPU, more than most multi-rank checks themselves).

The pool spawns its ranks at the first `run` (the spawn start method, as moebench.run.dist.spawn does; as many
ranks as that run needs, at most `max_size`; a later, larger run restarts it larger), joins them in one gloo group
and makes the prefix groups ranks 0..R-1 (R = 2..size) up front: gloo's new_group is collective over the whole
world. `pool.run(fn, R, args)` has ranks 0..R-1 call `fn(ctx, *args)` with `ctx` a RunContext whose group is that
prefix group (rank = its rank there, world_size = R), the others idle, and returns the results in rank order, as
`mdist.spawn(fn, R, backend="gloo", args=args)` would. `fn` must pass `ctx.group` to its collectives (moebench's
dispatch paths do): the default group is the whole pool.

Bounded and leaving nothing behind: a task past `timeout_s`, a rank that raises (its peers may be stuck in a
collective) or dies, ends the pool (every rank killed) and raises SpawnError naming the rank and its error; the
next `run` starts a fresh pool. The ranks die with the test process (moebench.run.dist.die_with_parent) and the
fixture closes the pool at the end of the session.

What moebench.run.dist.spawn itself does (start-up, failures, timeouts, environment) is tested on real spawns in
tests/run/test_dist.py, and through the runner in tests/run/test_runner_multirank.py, test_point_isolation.py and
test_faults.py: those do not use the pool."""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch

from moebench.run import dist as mdist
from moebench.run.dist import SpawnError

POOL_SIZE = 4
START_TIMEOUT_S = 240.0
PG_TIMEOUT_S = 120.0


def _serve(rank: int, size: int, port: int, conn, parent_pid: int, env: dict) -> None:
    """Body of one pool rank: join the group, make the prefix groups, then run tasks until told to stop."""
    mdist.die_with_parent(parent_pid)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    mdist.apply_env_defaults()
    import torch.distributed as dist

    from moebench.registry import RunContext

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
        groups = {n: dist.new_group(list(range(n))) for n in range(2, size)}
        groups[size] = dist.group.WORLD
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - the parent must hear of it
        conn.send(("error", mdist._exception_line(e), traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the test process went away
        if task is None:
            break
        fn, world, args = task
        ctx = RunContext(device=torch.device("cpu"), rank=rank, world_size=world, group=groups[world])
        try:
            conn.send(("ok", fn(ctx, *args)))
        except BaseException as e:  # noqa: BLE001
            tb = traceback.format_exc()
            sys.stderr.write(f"[gloo pool rank {rank}] {tb}")
            sys.stderr.flush()
            try:
                conn.send(("error", mdist._exception_line(e), tb))
            finally:
                os._exit(1)  # a peer may be stuck in a collective with this rank: the pool is done
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - teardown is best effort
        pass
    os._exit(0)


class GlooPool:
    def __init__(self, max_size: int = POOL_SIZE):
        self.max_size = max_size
        self.size = 0
        self.procs: list = []
        self.conns: list = []

    # -- life cycle ------------------------------------------------------------------------------------------
    def _start(self, size: int) -> None:
        import torch.multiprocessing as mp

        self.size = size

        ctx = mp.get_context("spawn")
        port = mdist.free_port()
        env = {k: os.environ.get(k, v) for k, v in mdist.ENV_DEFAULTS.items()}
        try:
            for rank in range(self.size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_serve, name=f"gloo-pool-rank{rank}", daemon=True,
                                args=(rank, self.size, port, child, os.getpid(), env))
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._collect(range(self.size), START_TIMEOUT_S, "start")
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 10.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        mdist._stop(self.procs)
        for c in self.conns:
            c.close()
        self.procs, self.conns, self.size = [], [], 0

    @property
    def started(self) -> bool:
        return bool(self.procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- tasks -----------------------------------------------------------------------------------------------
    def _collect(self, ranks, timeout_s: float, what: str) -> list:
        """One reply from each of `ranks`; on a failure or timeout the pool is killed and SpawnError raised."""
        import multiprocessing.connection as mpc

        deadline = time.monotonic() + timeout_s
        pending = set(ranks)
        got: dict[int, object] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                raise SpawnError(f"gloo pool: {what} timed out after {timeout_s:g} s; ranks still running: "
                                 f"{sorted(pending)}")
            mpc.wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                     timeout=min(left, 1.0))
            for r in sorted(pending):
                if self.conns[r].poll():
                    try:
                        msg = self.conns[r].recv()
                    except (EOFError, OSError):
                        msg = ("error", f"exited with code {self.procs[r].exitcode} without reporting", "")
                elif not self.procs[r].is_alive():
                    self.procs[r].join(2.0)
                    msg = ("error", f"exited with code {self.procs[r].exitcode} without reporting", "")
                else:
                    continue
                if msg[0] == "error":
                    self.close(kill=True)
                    raise SpawnError(f"rank {r} of {len(list(ranks))} failed: {msg[1]}", rank=r,
                                     child_traceback=msg[2])
                got[r] = msg[1]
                pending.discard(r)
        return [got[r] for r in sorted(got)]

    def run(self, fn, world_size: int, args: tuple = (), timeout_s: float = 240.0) -> list:
        """`fn(ctx, *args)` on ranks 0..world_size-1 (2 <= world_size <= max_size); the results in rank order."""
        if not 2 <= world_size <= self.max_size:
            raise ValueError(f"gloo pool: world_size {world_size} outside 2..{self.max_size}")
        if world_size > self.size:
            self.close()
            self._start(world_size)
        for r in range(world_size):
            self.conns[r].send((fn, world_size, args))
        return self._collect(range(world_size), timeout_s, f"{getattr(fn, '__name__', fn)} on {world_size} ranks")
