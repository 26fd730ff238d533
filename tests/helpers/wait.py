"""Waiting for a condition: the one `eventually` (and its async twin) every test uses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx

T = TypeVar("T")
# What a check may raise while its condition is not met yet (retried, reported if it never is).
RETRIED = (AssertionError, httpx.HTTPError)
# Without an `interval`, checks start 20 ms apart and back off to MAX_INTERVAL_S: a condition met
# at once is seen at once, and a long wait does not run its check 50 times a second (on two shared
# cores that polling took CPU from the very processes being waited for).
FIRST_INTERVAL_S = 0.02
MAX_INTERVAL_S = 0.1


def _intervals(interval: float | None) -> Iterator[float]:
    """The pauses between checks: `interval` each time if given, else the backoff above."""
    pause = FIRST_INTERVAL_S if interval is None else interval
    while True:
        yield pause
        if interval is None:
            pause = min(pause * 1.5, MAX_INTERVAL_S)


def eventually(check: Callable[[], T], timeout: float = 10.0, interval: float | None = None) -> T:
    """Poll `check` until it returns a truthy value (returned); past `timeout`, fail with its last
    exception or falsy value."""
    deadline = time.monotonic() + timeout
    pauses = _intervals(interval)
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
            last = value
        except RETRIED as exc:
            last = exc
        time.sleep(next(pauses))
    raise AssertionError(f"condition not met within {timeout}s: {last!r}")


async def aeventually(check: Callable[[], T], timeout: float = 10.0, interval: float | None = None) -> T:
    """`eventually` for async tests: the (blocking) check runs in a thread so the loop keeps going."""
    deadline = time.monotonic() + timeout
    pauses = _intervals(interval)
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = await asyncio.to_thread(check)
            if value:
                return value
            last = value
        except RETRIED as exc:
            last = exc
        await asyncio.sleep(next(pauses))
    raise AssertionError(f"condition not met within {timeout}s: {last!r}")
