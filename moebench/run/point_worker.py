"""Single-rank points in a worker process the runner keeps, so that a point which kills its process (a signal, an
extension that aborts), loses the CUDA context (an illegal address, a device-side assert, an OOM that leaves the
context unusable) or never returns costs that point, not the run.

The worker is `python -m moebench.run.point_worker`, started with a socket to the runner: a fresh interpreter (CUDA
cannot be forked once the parent has touched it, a forked CPU process hangs in its first OpenMP region, and unlike
multiprocessing's spawn it never re-runs the caller's `__main__`). It is kept for the life of the runner process,
keyed by device and TRITON_INTERPRET, so JIT and allocator caches stay warm across points and across runs in one
process (the test suite). Per run the runner sends the sweep, the plugin modules it has imported, sys.path, the
MOEBENCH_* / TRITON_* environment and the run directory (RunContext.run_dir); per point it sends the point, the
worker answers with the record, and the runner writes it (one writer, nothing doubled). What the runner records
when a point does not come back:

- the worker died: `failed: worker died: SIGABRT` (or `exit code N`); a fresh worker runs the next point;
- the point ran past `timing.point_timeout_s` (counted from the point's hand-over: the worker's start-up is not
  in it): the worker is killed, `failed: timeout after N s (worker killed)`;
- the point came back but the CUDA context is no longer usable: the record's own reason plus `; the CUDA context
  was lost, worker restarted`.

An impl registered in the runner's process alone (`registry.register` from a script or a test, not through a
plugin module, an entry point or `moebench.plugins` from an importable module) is unknown to the worker: its points
run in the runner's process, unprotected, and their records say so (`isolation`). The worker imports the modules
that registered plugins in the runner (their import-time side effects happen there too).

The worker ignores SIGINT and SIGTERM (the runner's Ctrl-C / SIGTERM handling decides, and kills it) and dies with
its parent (moebench.run.dist.die_with_parent), so a killed run leaves no worker behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

# Per-point time limits when the sweep sets none: minutes on a GPU; the CPU (and Triton's interpreter above all)
# runs the same point hundreds of times slower.
DEFAULT_POINT_TIMEOUT_S = {"cuda": 600.0, "cpu": 3600.0}
START_TIMEOUT_S = 300.0  # a fresh interpreter importing torch, triton and moebench, then a run's plugins
_ENV_PREFIXES = ("MOEBENCH_", "TRITON_")
_WORKER_KEY_ENV = "TRITON_INTERPRET"  # read when triton is imported: a change needs a new worker
WORKER_COMMAND = [sys.executable, "-m", "moebench.run.point_worker"]  # + fd, device, parent pid


def point_timeout_s(timing, device: torch.device) -> float:
    if timing.point_timeout_s is not None:
        return float(timing.point_timeout_s)
    return DEFAULT_POINT_TIMEOUT_S["cuda" if device.type == "cuda" else "cpu"]


@dataclass
class Outcome:
    record: dict | None  # None: the worker does not know the impl (registered in the runner's process only)
    restarted: bool = False  # the worker that ran the point is gone (died, killed, or its CUDA context was lost)


class WorkerStartError(RuntimeError):
    """The worker did not come up (or could not load a run): no point has run in it."""


class WorkerGone(RuntimeError):
    """The worker was found dead before a point was handed to it (killed while idle): the point did not run."""


def _exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "no exit code"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def lost_record(point, sweep, reason: str) -> dict:
    """The record of a point whose worker did not return one."""
    from moebench.run.point import bare_record

    return bare_record(point, sweep, "failed", reason, worker_restarted=True)


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
        from moebench.run.point import error_line

        return error_line(e)


def with_lost_context(rec: dict, lost: str, what: str) -> dict:
    """`rec` marked failed because the CUDA context was lost during it (`what`: who was restarted)."""
    reason = rec.get("reason") if rec.get("status") != "ok" and rec.get("reason") else lost
    rec.update(status="failed", worker_restarted=True, reason=f"{reason}; the CUDA context was lost, {what}")
    return rec


def _run_message(sweep, run_dir) -> tuple:
    from moebench import plugins

    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k != _WORKER_KEY_ENV}
    run_dir = str(Path(run_dir).absolute()) if run_dir is not None else None
    return ("run", sweep, plugins.imported_modules(), list(sys.path), env, run_dir)


# ---------------------------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------------------------

def _apply_run(sweep, modules: list[str], path: list[str], env: dict[str, str], run_dir: str | None) -> None:
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES) and k != _WORKER_KEY_ENV and k not in env]:
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
            except Exception:  # noqa: BLE001 - the point then runs in the runner, said in its record
                pass


def worker_main(fd: int, device: str, parent_pid: int) -> None:
    from moebench.run.dist import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.set_inheritable(fd, False)  # a compiler it starts must not keep the runner's end from seeing it die
    conn = Connection(fd)
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:  # plain "cuda" is the current device, as in the runner
            torch.cuda.set_device(dev)
        from moebench import registry
        from moebench.registry import RunContext
        from moebench.run.point import error_line, execute_point
        from moebench.run.progress import throttled
        from moebench.records import json_ready

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
                sweep, run_dir = msg[1], msg[-1]
                # a point's own progress goes to the runner as it happens (moebench.run.progress)
                ctx = RunContext(device=dev, run_dir=Path(run_dir) if run_dir else None,
                                 progress_sink=throttled(lambda *report: conn.send(("progress", *report))))
                conn.send(("ok", None))
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", error_line(e)))
            continue
        point = msg[1]
        if point.impl not in registry.all_impls():
            conn.send(("unknown", None, None))
            continue
        try:
            rec = execute_point(point, sweep, ctx)
        except BaseException as e:  # noqa: BLE001 - execute_point catches what a case raises; this is the rest
            from moebench.run.point import bare_record

            rec = bare_record(point, sweep, "failed", error_line(e))
        lost = context_error(dev)
        conn.send(("record", json_ready(rec), lost))
        if lost:
            os._exit(3)


# ---------------------------------------------------------------------------------------------------------------
# The runner's side
# ---------------------------------------------------------------------------------------------------------------

class PointWorker:
    """One worker process for one device; `run_point` runs a point in it and returns the record."""

    def __init__(self, device: torch.device):
        self.device = device
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(WORKER_COMMAND + [str(theirs.fileno()), str(device), str(os.getpid())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False
        self.timed_out = False
        self.run_token = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self, timeout_s: float, tick=None):
        """The next message; None when the worker died (`self.timed_out` False) or `timeout_s` passed (True).
        `tick()`, if given, is called at each second of waiting."""
        import multiprocessing.connection as mpc

        self.timed_out = False
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return None
            if tick is not None:
                tick()
            if mpc.wait([self.conn], timeout=min(left, 1.0)) or self.conn.poll():
                try:
                    return self.conn.recv()
                except (EOFError, OSError):  # its end closed: it is dying
                    return None
            if self.proc.poll() is not None:
                return None

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:  # BrokenPipeError and kin: it died since the last message
            raise WorkerGone(f"worker died while idle: {self.exit_reason()}") from e

    def _wait_ready(self) -> None:
        if self.ready:
            return
        msg = self._recv(START_TIMEOUT_S)
        if msg is None or msg[0] != "ready":
            detail = msg[1].strip().splitlines()[-1] if msg else \
                (f"no answer in {START_TIMEOUT_S:g} s" if self.timed_out else f"worker died: {self.exit_reason()}")
            self.kill()
            raise WorkerStartError(f"the point worker did not start: {detail}")
        self.ready = True

    def start_run(self, sweep, token, run_dir=None) -> None:
        """Hand the worker a run's sweep, plugins, sys.path, environment and directory (once per run)."""
        self._wait_ready()
        self._send(_run_message(sweep, run_dir))
        msg = self._recv(START_TIMEOUT_S)
        if msg is None or msg[0] != "ok":
            detail = msg[1] if msg else f"worker died: {self.exit_reason()}"
            self.kill()
            raise WorkerStartError(f"the point worker could not load the sweep: {detail}")
        self.run_token = token

    def exit_reason(self) -> str:
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        return _exit_reason(self.proc.returncode)

    def run_point(self, point, sweep, timeout_s: float, token, run_dir=None, *, on_progress=None,
                  tick=None) -> Outcome:
        """Run `point` in the worker; its progress reports go to `on_progress(done, total, what, detail)` as they
        come, and `tick()` is called about once a second while it runs (both optional)."""
        if self.run_token is not token:
            self.start_run(sweep, token, run_dir)
        if not self.alive():
            raise WorkerGone(f"worker died while idle: {self.exit_reason()}")
        self._send(("point", point))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._recv(max(deadline - time.monotonic(), 0.0), tick=tick)
            if msg is None or msg[0] != "progress":
                break
            if on_progress is not None:
                on_progress(*msg[1:])
        if msg is None:
            if self.timed_out:
                self.kill()
                return Outcome(lost_record(point, sweep, f"timeout after {timeout_s:g} s (worker killed)"), True)
            return Outcome(lost_record(point, sweep, f"worker died: {self.exit_reason()}"), True)
        kind, rec, lost = msg
        if kind == "unknown":
            return Outcome(None)
        if lost:
            self.kill()
            return Outcome(with_lost_context(rec, lost, "worker restarted"), True)
        return Outcome(rec, False)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # it ignores SIGTERM
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        try:
            self.conn.close()
        except OSError:
            pass

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.conn.send(("stop",))
                self.proc.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


_WORKERS: dict[tuple[str, str], PointWorker] = {}


def _key(device: torch.device) -> tuple[str, str]:
    return (str(device), os.environ.get(_WORKER_KEY_ENV, ""))


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


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
