"""Adaptive wait for polling loops: busy-spin first, then sleeps that grow up to a cap."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SpinPolicy:
    """How a poller waits: `spin_s` of spinning (re-check, yield the core, re-check), then
    sleeps that start at `first_sleep_s` and double up to `max_sleep_s`.

    Spinning gives the lowest latency when the next message is due soon (the engine's step
    loop turns around in about a millisecond); sleeping keeps an idle worker from burning a
    core, and the cap bounds the latency a long-idle worker adds when work finally arrives.
    """

    spin_s: float = 1e-3
    first_sleep_s: float = 20e-6
    max_sleep_s: float = 1e-3

    def __post_init__(self) -> None:
        if self.spin_s < 0 or self.first_sleep_s <= 0 or self.max_sleep_s < self.first_sleep_s:
            raise ValueError(
                f"SpinPolicy needs spin_s >= 0 and 0 < first_sleep_s <= max_sleep_s, got {self}"
            )


class SpinTimer:
    """One wait: tracks the deadline and paces the caller's re-checks.

    Usage: `timer = SpinTimer(timeout_s)`; `while not ready(): timer.pause()` with
    `timer.expired()` checked by the caller, which knows what to say in its TimeoutError.
    """

    def __init__(self, timeout_s: float | None, policy: SpinPolicy | None = None) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout_s}")
        self._policy = policy or SpinPolicy()
        self._start = time.monotonic()
        self._deadline = None if timeout_s is None else self._start + timeout_s
        self._next_sleep_s = self._policy.first_sleep_s
        self.timeout_s = timeout_s

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def remaining(self) -> float | None:
        """Seconds left before the deadline (>= 0), or None when there is no deadline."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def remaining_ms(self) -> int:
        """Remaining time in whole milliseconds for zmq calls; -1 means wait forever."""
        remaining = self.remaining()
        return -1 if remaining is None else int(remaining * 1000)

    def expired(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def pause(self) -> None:
        """Return at once while in the spin window, else sleep and lengthen the next sleep."""
        now = time.monotonic()
        if now - self._start < self._policy.spin_s:
            # Not a sleep: returns at once on an idle core, but on an oversubscribed host it
            # lets the peer we wait for run (pure spinning measured 10x slower on 2 cores).
            os.sched_yield()
            return
        sleep_s = self._next_sleep_s
        if self._deadline is not None:
            sleep_s = min(sleep_s, max(0.0, self._deadline - now))
        time.sleep(sleep_s)
        self._next_sleep_s = min(self._next_sleep_s * 2, self._policy.max_sleep_s)
