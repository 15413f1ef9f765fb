"""One writer per run directory: `run.lock` holds the writer's pid, host and start time under an fcntl.flock.

The flock is the authority on this host: the kernel drops it when the holder dies, so a lock left by a killed run
is stale and simply taken over. A lock file naming another host (a shared filesystem, where flock may not reach)
is refused with the line that says how to clear it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import platform
from pathlib import Path

LOCK = "run.lock"


class RunLocked(ValueError):
    """Another live process writes this run directory. str() is the one line shown to the user."""


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started_utc', '?')}"
            if holder else "another process")


class RunLock:
    """`with RunLock(run_dir):` or acquire()/release(). Raises RunLocked when a live writer holds it."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise RunLocked(f"{self.path.parent}: cannot write there ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLocked(f"{self.path.parent}: in use by {_describe(_read_holder(self.path))} "
                                "(a run is still writing it)") from None
            # A holder that released between our open and our flock unlinked the file we locked: start again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = _read_holder(self.path)
        if holder and holder.get("host") != platform.node():
            os.close(fd)
            raise RunLocked(f"{self.path.parent}: locked by {_describe(holder)}; cannot tell from here whether "
                            f"it still runs (delete {self.path} if it does not)")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(),
                                 "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                 "took_over": holder or None}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
