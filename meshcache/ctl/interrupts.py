"""Stop signals in the `meshcache` commands: SIGINT (Ctrl-C), SIGTERM and SIGHUP raise
KeyboardInterrupt, so a command interrupted anywhere unwinds through its own cleanup (`up` stops
what it started) and ends with status 130 instead of a traceback."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def interrupt(signum: int, _frame: FrameType | None) -> None:
    """The stop signals' handler: a KeyboardInterrupt naming the signal, wherever the command is."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """The stop signals raise KeyboardInterrupt while inside; the previous handlers come back after
    (the CLI's main is also called in-process, by tests). Signals the caller ignores stay ignored
    (`nohup`, background jobs); only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(s, handler)


@contextmanager
def deferred_stop_signals() -> Iterator[None]:
    """The stop signals wait until the block is done, then go to the handler that was in place
    (`up`'s KeyboardInterrupt, the supervisor's stop): for a step that must finish once begun,
    e.g. starting a child and keeping its handle, so that it can always be stopped. Deferred in
    Python, not by blocking them: a blocked mask would be inherited by the child (across exec)
    and keep it from ever seeing SIGTERM. Only the main thread has handlers to defer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if received:
        handler = previous[signal.Signals(received[0])]
        if callable(handler):
            handler(received[0], None)
        elif handler != signal.SIG_IGN:
            signal.raise_signal(received[0])  # the default action (SIG_DFL restored above)
