"""Waiting for a condition with a deadline, instead of sleeping a guessed time and asserting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Short enough that a test resumes soon after the condition holds, long enough not to hog
# one of the few cores the engine or server under test also needs.
POLL_INTERVAL_S = 0.005


def _failure(message: str | Callable[[], str], timeout: float) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"{text} (still not so after {timeout:g} s)")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    message: str | Callable[[], str],
    interval: float = POLL_INTERVAL_S,
) -> T:
    """Poll `predicate` until it returns something truthy, and return that; raise
    AssertionError with `message` (a string, or a callable that describes the state then)
    once `timeout` seconds pass without it."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise _failure(message, timeout)
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T],
    timeout: float,
    message: str | Callable[[], str],
    interval: float = POLL_INTERVAL_S,
) -> T:
    """`wait_until` for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise _failure(message, timeout)
        await asyncio.sleep(interval)
