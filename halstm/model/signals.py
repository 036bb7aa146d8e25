"""SIGINT, SIGTERM and SIGHUP for a training run: checkpoint, then exit as
the shell expects (128 + the signal's number: 130, 143, 129).

    with signals.guard() as g:          # handlers installed (main thread only)
        g.deferred = False              # setup, first build: a signal raises Interrupted
        ...
        g.deferred = True               # training: a signal only sets g.signum,
        while g.signum is None: ...     # the loop finishes its step and saves
                                        # a second signal raises Interrupted at once

Interrupted is a KeyboardInterrupt, so that code which cleans up after
Ctrl-C (atomic writes, the kernel cache's temporary build folders) does
the same after SIGTERM and SIGHUP. Guards nest: an inner guard() reuses
the outer one, so that `halstm train` covers setup and Trainer.run() the
loop with one set of handlers.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(signum: int) -> int:
    """The status a shell reports for a process ended by signum."""
    return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
    """Raised by a guard's handler where a signal cannot wait (setup, a
    first build, a second signal)."""

    def __init__(self, signum: int):
        super().__init__(name(signum))
        self.signum = int(signum)

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


class Guard:
    """What the handlers saw: signum, the first signal's number (None: none
    yet). deferred: whether a first signal waits for the owner to poll it."""

    def __init__(self, active: bool):
        self.active = active            # False: not the main thread, nothing installed
        self.signum: int | None = None
        self.deferred = False

    def handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            if self.deferred:
                return
        raise Interrupted(signum)

    def check(self) -> None:
        """Raise Interrupted if a signal came (for code that is not deferring
        and may have swallowed the handler's exception)."""
        if self.signum is not None:
            raise Interrupted(self.signum)


_current: Guard | None = None


@contextmanager
def guard(enabled: bool = True):
    """A Guard with handlers for SIGNALS installed for the block (the
    previous handlers put back after it), or the enclosing block's Guard.
    Outside the main thread (or enabled False) a Guard that never fires."""
    global _current
    if _current is not None:
        yield _current
        return
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield Guard(active=False)
        return
    g = Guard(active=True)
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _current = g
    try:
        for s in SIGNALS:
            signal.signal(s, g.handle)
        yield g
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        _current = None
