"""The engine's shutdown bound: one deadline that every wait of a shutdown path takes its share of."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# `LLM.shutdown`, an `LLM`'s garbage collection and interpreter exit stop the workers and free
# what they hold within this, whatever state the workers, the queues or a Ray cluster are in.
SHUTDOWN_BOUND_S = 10.0
# Of which workers get up to this long to read "shutdown" and stop by themselves; the rest of
# the bound is for stopping them by force (terminate, then kill) and sweeping what they left.
GRACEFUL_S = 5.0


class Deadline:
    """A point in monotonic time; each wait asks how long it may take (`remaining`)."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def remaining(self, cap: float | None = None) -> float:
        """Seconds left, never below 0 and at most `cap`."""
        left = max(0.0, self._end - time.monotonic())
        return left if cap is None else min(left, cap)

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def within(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now, or this one if it comes first."""
        sub = Deadline(0.0)
        sub._end = min(self._end, time.monotonic() + seconds)
        return sub


class CallTimedOut(TimeoutError):
    """A bounded call did not return in time; it goes on in a daemon thread, abandoned."""


def call_bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """`fn()`'s result, or CallTimedOut after `timeout` seconds; what it raises, it raises here.

    For calls into libraries that may block without a timeout of their own (Ray's calls to a
    GCS that is gone wait for it to come back): the call runs on a daemon thread, which is
    left behind if it does not return, so that it cannot keep the interpreter from exiting.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name=f"hybridllm-shutdown-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimedOut(f"{what} did not return within {timeout:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")
