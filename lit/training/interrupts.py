"""Ctrl-C that is never lost and never breaks a checkpoint.

Python raises a SIGINT's KeyboardInterrupt at whatever line runs next. Inside a ``__del__`` or a weakref
callback it is printed ("Exception ignored in ...") and dropped, so a fit could go on training for hours after
Ctrl-C; inside ``torch.save`` it leaves a half-written zip and surfaces as a RuntimeError. While
:func:`interrupt_requests` is installed, a SIGINT is a request that is remembered: it raises at once (as
before), again at the next batch boundary (:class:`lit.training.guards.InterruptAtBatchBoundaries`) in case
the first was dropped, and is held back inside :func:`interrupts_deferred` (a checkpoint being written) until its end.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class InterruptRequests:
    """The SIGINT handler: ``requested`` once a SIGINT came; raises KeyboardInterrupt unless deferred."""

    def __init__(self):
        self.requested = False
        self.deferring = 0

    def __call__(self, signum, frame) -> None:
        self.requested = True
        if not self.deferring:
            raise KeyboardInterrupt

    def raise_if_requested(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


def installed_requests() -> InterruptRequests | None:
    """The :class:`InterruptRequests` handling SIGINT now, if one is."""
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, InterruptRequests) else None


@contextlib.contextmanager
def interrupt_requests():
    """Inside (in the main thread; elsewhere a no-op): SIGINT handled by a new :class:`InterruptRequests`,
    the previous handler back at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    requests = InterruptRequests()
    previous = signal.signal(signal.SIGINT, requests)
    try:
        yield requests
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """Inside: a SIGINT is only remembered; it raises when the block has ended without an error."""
    requests = installed_requests()
    if requests is None:
        yield
        return
    requests.deferring += 1
    try:
        yield
    finally:
        requests.deferring -= 1
    if not requests.deferring:
        requests.raise_if_requested()
