"""A progress line on a timer: said whenever ``every`` seconds pass without one, so that a step or a
measurement longer than the interval still shows the run is alive (lines at step ends alone leave a log
silent for as long as the longest step)."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

from lit.training.errors import UsageError

PROGRESS_SECONDS = "FLEXMOBA_PROGRESS_SECONDS"
DEFAULT_PROGRESS_SECONDS = 60.0


def progress_seconds() -> float:
    """The most seconds between two progress lines: ``$FLEXMOBA_PROGRESS_SECONDS``, default 60."""
    given = os.environ.get(PROGRESS_SECONDS, "").strip()
    if not given:
        return DEFAULT_PROGRESS_SECONDS
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise UsageError(PROGRESS_SECONDS, f"must be a number of seconds >= 0, got {given!r}",
                         f"e.g. {PROGRESS_SECONDS}=60, or 0 for a line every step")
    return seconds


class Ticker:
    """Says ``line()`` (through ``say``) each time ``every`` seconds pass since the last line said, by
    this or by the caller (:meth:`said`); ``line()`` returning None says nothing. A daemon thread,
    started by :meth:`start` and ended by :meth:`stop` (or leaving the ``with`` block)."""

    def __init__(self, every: float, line: Callable[[], str | None], say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.every, self.line, self.say, self.clock = every, line, say, clock
        self.last = clock()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def said(self) -> None:
        """A line was said now, elsewhere: the next tick is ``every`` seconds away."""
        with self.lock:
            self.last = self.clock()

    def due(self) -> bool:
        """Whether ``every`` seconds passed since the last line; if so, counts a line as said now."""
        with self.lock:
            now = self.clock()
            if now - self.last < self.every:
                return False
            self.last = now
            return True

    def start(self) -> Ticker:
        if self.every > 0 and self.thread is None:
            self.said()
            self.thread = threading.Thread(target=self._run, name="flexmoba-progress", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _run(self) -> None:
        while not self.stopped.wait(max(0.05, self.every - (self.clock() - self.last))):
            if self.due():
                text = self.line()
                if text is not None:
                    self.say(text)

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
