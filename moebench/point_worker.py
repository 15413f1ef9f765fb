"""Single-rank points in a worker process the runner keeps, so that a point which kills its process (a signal, an
extension that aborts), loses the CUDA context (an illegal address, a device-side assert, an OOM that leaves the
context unusable) or never returns costs that point, not the run.

The worker is spawned (CUDA cannot be forked once the parent has touched it, and a forked CPU process hangs in its
first OpenMP region) and kept for the life of the runner process, keyed by device and TRITON_INTERPRET, so JIT and
allocator caches stay warm across points and across runs in one process (the test suite). Per run the runner
sends the sweep, the plugin modules it has imported, sys.path and the MOEBENCH_* / TRITON_* environment; per
point it sends the point, the worker answers with the record, and the runner writes it (one writer, nothing
doubled). What the runner records when a point does not come back:

- the worker died: `failed: worker died: SIGABRT` (or `exit code N`); a fresh worker runs the next point;
- the point ran past `timing.point_timeout_s`: the worker is killed, `failed: timeout after N s`;
- the point came back but the CUDA context is no longer usable: the record's own reason plus `; the CUDA context
  was lost, worker restarted`.

An impl registered in the runner's process alone (`registry.register` from a script or a test, not through a
plugin module, an entry point or `moebench.plugins` from an importable module) is unknown to the worker: its points
run in the runner's process, unprotected, and their records say so (`isolation`).

The worker ignores SIGINT and SIGTERM (the runner's Ctrl-C / SIGTERM handling decides, and kills it) and dies with
its parent (moebench.dist.die_with_parent), so a killed run leaves no worker behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch

# Per-point time limits when the sweep sets none: minutes on a GPU; the CPU (and Triton's interpreter above all)
# runs the same point hundreds of times slower.
DEFAULT_POINT_TIMEOUT_S = {"cuda": 600.0, "cpu": 3600.0}
START_TIMEOUT_S = 300.0  # a fresh interpreter importing torch, triton and moebench
_ENV_PREFIXES = ("MOEBENCH_", "TRITON_")
_RESTART_KEY = "TRITON_INTERPRET"  # read when triton is imported: a change needs a new worker


def point_timeout_s(timing, device: torch.device) -> float:
    if timing.point_timeout_s is not None:
        return float(timing.point_timeout_s)
    return DEFAULT_POINT_TIMEOUT_S["cuda" if device.type == "cuda" else "cpu"]


@dataclass
class Outcome:
    record: dict | None  # None: the worker does not know the impl (registered in the runner's process only)
    restarted: bool = False  # the worker that ran the point is gone (died, killed, or its CUDA context was lost)


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def failed_record(point, sweep, reason: str) -> dict:
    """The record of a point whose worker did not return one (the fields every record carries)."""
    return {"point": point.index, "key": point.key, "impl": point.impl, "target": sweep.target,
            "params": point.params.to_dict(), "status": "failed", "reason": reason, "worker_restarted": True}


def context_error(device: torch.device) -> str | None:
    """None while the CUDA context still runs work; else the error that says it was lost (sticky errors surface
    at the next synchronisation, whoever calls it)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        probe = torch.ones(1, device=device)
        if float((probe + 1).item()) != 2.0:
            return "a probe kernel returned a wrong value"
        return None
    except Exception as e:  # noqa: BLE001 - any failure here means the context is gone
        from moebench.point import error_line

        return error_line(e)


def _plugin_modules() -> list[str]:
    from moebench import plugins

    return plugins.imported_modules()


def _run_message(sweep) -> tuple:
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k != _RESTART_KEY}
    return ("run", sweep, _plugin_modules(), list(sys.path), env)


# ---------------------------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------------------------

def _apply_run(sweep, modules: list[str], path: list[str], env: dict[str, str]) -> None:
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES) and k != _RESTART_KEY and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    from moebench import registry
    from moebench.plugins import load_plugins

    registry.load_all()
    load_plugins(list(sweep.plugins), sweep.source)
    for mod in modules:  # plugins registered by modules the runner imported itself (not through the sweep)
        if mod != "__main__":
            try:
                __import__(mod)
            except Exception:  # noqa: BLE001 - the point then fails naming its unknown impl
                pass


def _worker_main(conn, device: str, parent_pid: int) -> None:
    from moebench.dist import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:  # plain "cuda" is the current device, as in the runner
            torch.cuda.set_device(dev)
        from moebench import registry
        from moebench.point import error_line, execute_point
        from moebench.registry import RunContext

        ctx = RunContext(device=dev)
        conn.send(("ready", os.getpid()))
    except BaseException:  # noqa: BLE001 - the runner reports it
        conn.send(("error", traceback.format_exc(limit=6)))
        os._exit(1)
    sweep = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "stop":
            os._exit(0)
        if msg[0] == "run":
            try:
                _apply_run(*msg[1:])
                sweep = msg[1]
                conn.send(("ok", None))
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", error_line(e)))
            continue
        point = msg[1]
        if point.impl not in registry.all_impls():
            conn.send(("unknown", None, None))  # registered in the runner's process only
            continue
        try:
            rec = execute_point(point, sweep, ctx)
        except BaseException as e:  # noqa: BLE001 - execute_point catches what a case raises; this is the rest
            rec = failed_record(point, sweep, error_line(e))
            rec.pop("worker_restarted")
        lost = context_error(dev)
        conn.send(("record", rec, lost))
        if lost:
            os._exit(3)


# ---------------------------------------------------------------------------------------------------------------
# The runner's side
# ---------------------------------------------------------------------------------------------------------------

class WorkerStartError(RuntimeError):
    pass


class PointWorker:
    """One worker process for one device; `run_point` runs a point in it and returns the record."""

    def __init__(self, device: torch.device):
        import torch.multiprocessing as mp

        self.device = device
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, name="moebench-point-worker", daemon=True,
                                args=(child, str(device), os.getpid()))
        self.proc.start()
        child.close()
        self.ready = False
        self.sweep_id = None

    def alive(self) -> bool:
        return self.proc.is_alive()

    def _recv(self, timeout_s: float):
        """The next message; None when the worker died (`self.timed_out` False) or `timeout_s` passed (True)."""
        import multiprocessing.connection as mpc

        self.timed_out = False
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return None
            ready = mpc.wait([self.conn, self.proc.sentinel], timeout=min(left, 1.0))
            if self.conn in ready or self.conn.poll():
                try:
                    return self.conn.recv()
                except (EOFError, OSError):  # its end closed: it is dying
                    return None
            if self.proc.sentinel in ready:
                return None

    def _wait_ready(self) -> None:
        if self.ready:
            return
        msg = self._recv(START_TIMEOUT_S)
        if msg is None or msg[0] != "ready":
            detail = msg[1].strip().splitlines()[-1] if msg else f"worker died: {self.exit_reason()}"
            self.kill()
            raise WorkerStartError(f"the point worker did not start: {detail}")
        self.ready = True

    def start_run(self, sweep) -> None:
        """Hand the worker this run's sweep (once per run; its plugins are imported there)."""
        self._wait_ready()
        self.conn.send(_run_message(sweep))
        msg = self._recv(START_TIMEOUT_S)
        if msg is None or msg[0] != "ok":
            detail = msg[1] if msg else f"worker died: {self.exit_reason()}"
            self.kill()
            raise WorkerStartError(f"the point worker could not load the sweep: {detail}")
        self.sweep_id = id(sweep)

    def exit_reason(self) -> str:
        self.proc.join(5.0)
        return _signal_name(self.proc.exitcode)

    def run_point(self, point, sweep, timeout_s: float) -> Outcome:
        if self.sweep_id != id(sweep):
            self.start_run(sweep)
        self.conn.send(("point", point))
        msg = self._recv(timeout_s)
        if msg is None:
            if self.timed_out:
                self.kill()
                return Outcome(failed_record(point, sweep, f"timeout after {timeout_s:g} s (worker killed)"), True)
            return Outcome(failed_record(point, sweep, f"worker died: {self.exit_reason()}"), True)
        kind, rec, lost = msg
        if kind == "unknown":
            return Outcome(None)
        if lost:
            rec["reason"] = "; ".join(x for x in (rec.get("reason") or (f"CUDA error: {lost}"),
                                                  "the CUDA context was lost, worker restarted") if x)
            if rec.get("status") == "ok":
                rec["status"] = "failed"
            rec["worker_restarted"] = True
            self.proc.join(10.0)
            self.kill()
            return Outcome(rec, True)
        return Outcome(rec, False)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # it ignores SIGTERM
        self.proc.join(10.0)
        try:
            self.conn.close()
        except OSError:
            pass

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.proc.join(5.0)
        except (OSError, BrokenPipeError):
            pass
        self.kill()


_WORKERS: dict[tuple[str, str], PointWorker] = {}


def _key(device: torch.device) -> tuple[str, str]:
    return (str(device), os.environ.get(_RESTART_KEY, ""))


def get_worker(device: torch.device) -> PointWorker:
    """This process's worker for `device` (started now if there is none or the last one is gone)."""
    key = _key(device)
    w = _WORKERS.get(key)
    if w is None or not w.alive():
        w = _WORKERS[key] = PointWorker(device)
    return w


def prestart(device: torch.device) -> None:
    """Start the worker now so its interpreter start-up overlaps the runner's own (the run directory, manifest)."""
    get_worker(device)


def drop(device: torch.device) -> None:
    w = _WORKERS.pop(_key(device), None)
    if w is not None:
        w.kill()


@atexit.register
def _stop_all() -> None:
    for w in list(_WORKERS.values()):
        w.stop()
    _WORKERS.clear()
