"""A child process held with SIGSTOP (its listening socket still accepts, nothing answers: a
stalled, not a dead, dependency), always resumed."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator

from meshcache.ctl import procs


@contextlib.contextmanager
def stopped(proc: procs.Proc) -> Iterator[Callable[[], None]]:
    """`proc` SIGSTOPped inside the block; the yielded function resumes it early, and it is
    resumed (SIGCONT) on the way out in any case, so no test leaves a process stopped."""
    os.kill(proc.popen.pid, signal.SIGSTOP)
    resumed = False

    def resume() -> None:
        nonlocal resumed
        if not resumed:
            resumed = True
            os.kill(proc.popen.pid, signal.SIGCONT)

    try:
        yield resume
    finally:
        resume()
