"""What a user sees while a run goes: the run's progress (points done of the total, elapsed, an estimate of what is
left) and, inside a long point, the point's own (what its bench reports through `RunContext.progress`, relayed from
the point worker).

On a terminal (stderr) it is one line, redrawn in place and erased before a table row is printed; otherwise (a log)
a line every REPORT_EVERY_S seconds. The estimate of what is left is the measured rate once a point has finished
(counting the current point's own fraction done), the run's cost estimate before that (moebench.run.estimate), and
never a made-up zero: with neither it says it has none yet, and past the estimate (or past a point's own count-down)
it says so while work remains, never "~0s left". A point's own estimate (its rate so far) never counts up:
between two of its reports it counts down from the figure last shown.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

REPORT_EVERY_S = 30.0  # not a terminal: one progress line this often
REDRAW_EVERY_S = 0.25  # a terminal: the line is redrawn at most this often (unless forced)
SEND_EVERY_S = 0.5  # the point worker relays a point's progress at most this often (first and last always)


def duration(seconds: float) -> str:
    """45s, 12m05s, 3h02m."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class _Inner:
    """The latest report of the point in flight, when its series (what, total) began, and the time it had left as
    last shown (`left_s` at `left_at`): what the line shows next never exceeds that minus the time since."""

    done: int
    total: int
    what: str
    detail: str
    since: float
    left_s: float | None = None
    left_at: float = 0.0

    def left(self, now: float) -> float | None:
        """Seconds the series has left at `now`: its rate so far, and never more than the last figure shown counted
        down (between two reports the rate alone would grow with the time waited)."""
        took = now - self.since
        if not (0 < self.done < self.total and took > 0):
            return None
        rate_left = took / self.done * (self.total - self.done)
        if self.left_s is not None:
            rate_left = min(rate_left, max(self.left_s - (now - self.left_at), 0.0))
        self.left_s, self.left_at = rate_left, now
        return rate_left


def throttled(send: Callable[[int, int, str, str], None], clock: Callable[[], float] = time.monotonic,
              every_s: float = SEND_EVERY_S) -> Callable[[int, int, str, str], None]:
    """`send`, with reports that differ from the last one sent only by `done` sent at most every `every_s`
    seconds; a new series or detail, and a series' first and last report, always go."""
    last: list = [float("-inf"), None]

    def report(done: int, total: int, what: str, detail: str = "") -> None:
        now = clock()
        if done <= 0 or done >= total or last[1] != (what, total, detail) or now - last[0] >= every_s:
            last[0], last[1] = now, (what, total, detail)
            send(done, total, what, detail)
    return report


class RunProgress:
    """The progress of one run of `total` points (`estimate_s`: the cost estimate, used until a point finishes)."""

    def __init__(self, total: int, *, estimate_s: float | None = None, prefix: str = "",
                 stream: TextIO | None = None, terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.estimate_s = estimate_s
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.clock = clock
        self.t0 = clock()
        self.done = 0
        self.label = ""
        self.point_t0 = self.t0
        self.inner: _Inner | None = None
        self._drawn = 0  # characters of the line now on the terminal
        self._last_draw = float("-inf")
        self._last_report = self.t0

    # what the runner tells it
    def start_point(self, label: str) -> None:
        self.label, self.point_t0, self.inner = label, self.clock(), None
        self._show(force=True)

    def point_report(self, done: int, total: int, what: str, detail: str = "") -> None:
        """The point in flight reported `done` of `total` `what` (its bench's RunContext.progress)."""
        now = self.clock()
        same = self.inner is not None and (self.inner.what, self.inner.total) == (what, total) and \
            done >= self.inner.done
        since = self.inner.since if same else now
        left = (self.inner.left_s, self.inner.left_at) if same else (None, 0.0)
        self.inner = _Inner(int(done), int(total), str(what), str(detail), since, *left)
        self._show()

    def tick(self) -> None:
        """Time passed with nothing new (the runner waits on a point): refresh the elapsed figures."""
        self._show()

    def point_done(self) -> None:
        self.done += 1
        self.inner = None

    def clear(self) -> None:
        """Erase the line (before a row is printed, at the end, before an interrupt's message)."""
        if self.terminal and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0

    # the line
    def left_s(self) -> float | None:
        """Seconds the run has left, or None when nothing says yet."""
        el = self.clock() - self.t0
        frac = 0.0
        if self.inner is not None and self.inner.total > 0:
            frac = min(self.inner.done / self.inner.total, 1.0)
        done = self.done + frac
        if self.done >= 1 and done > 0:
            return el / done * (self.total - done)
        if self.estimate_s is not None:
            return max(self.estimate_s - el, 0.0)  # 0 once past it: line() says so instead of "~0s"
        return None

    def line(self) -> str:
        now = self.clock()
        left = self.left_s()
        if left is None:
            eta = "no estimate before the first point ends"
        elif left <= 0 and self.done < self.total:  # work remains: never "~0s left"
            eta = f"past the estimate of {duration(self.estimate_s or 0.0)}, no new one before a point ends"
        else:
            eta = f"~{duration(left)} left" + (" (estimated)" if self.done == 0 else "")
        text = f"{self.prefix}[{self.done}/{self.total}] {duration(now - self.t0)} elapsed, {eta}"
        if self.label:
            text += f" | {self.label}"
        i = self.inner
        if i is not None:
            text += f": {i.what} {i.done}/{i.total}" + (f" ({i.detail})" if i.detail else "")
            left = i.left(now)
            if left is not None and left < 0.5 and i.done < i.total:  # the count-down ran out while work remains
                text += ", longer than its rate so far said"
            elif left is not None:
                text += f", ~{duration(left)} left in it"
        text += f", {duration(now - self.point_t0)} in this point" if self.label else ""
        return text

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        if self.terminal:
            if not force and now - self._last_draw < REDRAW_EVERY_S:
                return
            self._last_draw = now
            text = self.line()[:max(shutil.get_terminal_size((200, 24)).columns - 1, 20)]
            pad = max(self._drawn - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._drawn = len(text)
        elif now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            self.stream.write(f"moebench: {self.line()}\n")
            self.stream.flush()
