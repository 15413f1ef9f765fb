"""moebench.run.dist: self-spawned gloo ranks, failure propagation (no hangs), per-iteration max over ranks."""

import os
import time

import pytest
import torch

from moebench.run import dist as mdist
from moebench.run.dist import SpawnError


# Workers are module-level so the spawn start method can pickle them.
def _ranks_and_maxima(ctx, samples_by_rank):
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    got = mdist.max_over_ranks(samples_by_rank[ctx.rank], ctx.group)
    return {"rank": ctx.rank, "world": ctx.world_size, "device": str(ctx.device), "sum": float(t),
            "max": got.per_iter_max, "argmax": got.per_iter_argmax, "slowest": got.slowest_rank,
            "counts": got.argmax_counts, "env": {k: os.environ.get(k) for k in mdist.ENV_DEFAULTS},
            "interpret": os.environ.get("TRITON_INTERPRET")}


def _raise_on_rank(ctx, bad_rank):
    import torch.distributed as dist

    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure\non rank {bad_rank}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the healthy ranks block here until they are terminated
    dist.barrier()
    return "unreachable"


def _exit_on_rank(ctx, bad_rank):
    import torch.distributed as dist

    if ctx.rank == bad_rank:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def _sleep_forever(ctx):
    time.sleep(3600)


def _maxima_twice(ctx, samples_by_rank, tied_by_rank):
    return _ranks_and_maxima(ctx, samples_by_rank), mdist.max_over_ranks(tied_by_rank[ctx.rank], ctx.group)


SAMPLES = [[5.0, 1.0, 3.0, 2.0], [4.0, 6.0, 3.0, 1.0], [1.0, 2.0, 7.0, 9.0]]
TIED = [[2.0, 2.0], [2.0, 1.0], [1.0, 2.0]]  # the max 2.0 on ranks 0 and 1 at i=0, on ranks 0 and 2 at i=1


@pytest.fixture(scope="module")
def three_ranks():
    """One spawn of 3 gloo ranks for both max-over-ranks tests (each rank costs an interpreter start)."""
    t0 = time.monotonic()
    out = mdist.spawn(_maxima_twice, 3, backend="gloo", args=(SAMPLES, TIED), timeout_s=120)
    return out, time.monotonic() - t0


def test_spawn_results_env_and_max_over_ranks(three_ranks):
    both, elapsed = three_ranks
    assert elapsed < 60
    out = [o for o, _ in both]
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["world"] == 3 and o["device"] == "cpu" and o["sum"] == 6.0
        assert o["max"] == [5.0, 6.0, 7.0, 9.0]
        # ties (3.0 on ranks 0 and 1 at i=2 is below rank 2's 7.0) resolve to the lowest rank
        assert o["argmax"] == [0, 1, 2, 2]
        assert o["slowest"] == 2 and o["counts"] == [1, 1, 2]
        for k, v in mdist.ENV_DEFAULTS.items():
            assert o["env"][k] == os.environ.get(k, v)
        assert o["interpret"] == os.environ.get("TRITON_INTERPRET")


def test_max_over_ranks_ties_go_to_lowest_rank(three_ranks):
    for _, got in three_ranks[0]:
        assert got.per_iter_max == [2.0, 2.0] and got.per_iter_argmax == [0, 0]
        assert got.slowest_rank == 0 and got.argmax_counts == [2, 0, 0]


def test_raising_rank_ends_the_run_with_its_error():
    # two ranks suffice: rank 1 raises while rank 0 waits in a healthy collective (terminated, not blamed)
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        mdist.spawn(_raise_on_rank, 2, backend="gloo", args=(1,), timeout_s=120, pg_timeout_s=100)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert msg.startswith("rank 1 of 2 failed: ValueError: on rank 1"), msg
    assert ei.value.rank == 1 and "deliberate failure" in ei.value.child_traceback
    assert elapsed < 40, f"took {elapsed:.1f} s (healthy ranks must be terminated, not waited for)"


def test_dying_rank_is_reported():
    # two ranks suffice: the last rank dies silently, rank 0's broken collective is fallout, not the cause
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 of 2 failed: exited with code 3"):
        mdist.spawn(_exit_on_rank, 2, backend="gloo", args=(1,), timeout_s=120, pg_timeout_s=100)
    assert time.monotonic() - t0 < 40


def test_hanging_ranks_hit_the_timeout():
    # 2 s: the deadline counts from the spawn, so the ranks may still be starting when it passes (they never report
    # either way); the parent stops them all the same
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"timed out after 2 s; ranks still running: \[0, 1\]"):
        mdist.spawn(_sleep_forever, 2, backend="gloo", timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_single_process_helpers():
    assert mdist.rank_seed(3, 2) != mdist.rank_seed(3, 1)
    got = mdist.max_over_ranks([1.0, 2.0])  # no process group: identity
    assert got.per_iter_max == [1.0, 2.0] and got.slowest_rank == 0
    p = mdist.free_port()
    assert 0 < p < 65536
