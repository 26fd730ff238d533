"""Waiting for a condition: the one `eventually` (and its async twin) every test uses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")
# What a check may raise while its condition is not met yet (retried, reported if it never is).
RETRIED = (AssertionError, httpx.HTTPError)


def eventually(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll `check` until it returns a truthy value (returned); past `timeout`, fail with its last
    exception or falsy value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
            last = value
        except RETRIED as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s: {last!r}")


async def aeventually(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """`eventually` for async tests: the (blocking) check runs in a thread so the loop keeps going."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = await asyncio.to_thread(check)
            if value:
                return value
            last = value
        except RETRIED as exc:
            last = exc
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s: {last!r}")
