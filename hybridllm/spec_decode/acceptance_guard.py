"""Per request: keep drafting only while the drafts are accepted often enough to pay."""

from __future__ import annotations

import math


class AcceptanceGuard:
    """Tracks the recent fraction of a request's drafts that were accepted.

    A verify step costs more than a plain one (each draft is one more row through every
    layer), so drafts that are mostly rejected make decoding slower. Below `min_rate` the guard
    pauses drafting for a number of steps that doubles each time it trips (up to
    `max_pause`), then lets the request try again; a good step resets the pause. The default
    `min_rate` is about where a 4-draft verify step of the embedded model on a 2-core CPU
    (1.5 decode steps' time since its weights compute in x8 groups, docs/benchmarks.md) stops
    paying for itself: 0.4, set when that step took 2.1-2.4, paused drafting in 152 of 287 steps
    of the grounded benchmark's prompts, 0.2 in 48 of 230.
    """

    def __init__(
        self, min_rate: float = 0.2, weight: float = 0.5, first_pause: int = 4, max_pause: int = 64
    ) -> None:
        self.min_rate = min_rate
        self.weight = weight  # of the latest step in the running rate
        self.first_pause = first_pause
        self.max_pause = max_pause
        self.rate = 1.0  # start hopeful: a first draft is always tried
        self._pause = 0  # steps left without drafts
        self._next_pause = first_pause
        self._seen = (0, 0)  # (drafted, accepted) counts already folded into `rate`

    def should_draft(self) -> bool:
        """Whether this step may draft (a paused step counts down the pause)."""
        if self._pause > 0:
            self._pause -= 1
            return False
        return True

    def draft_length(self, k: int) -> int:
        """How many of up to `k` drafts to verify: fewer while the rate is low (each costs a
        row through every layer), all of them while it is high."""
        return max(1, min(k, math.ceil(self.rate * k) + 1))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in the request's running totals of drafted and accepted tokens."""
        drafted = num_drafted - self._seen[0]
        accepted = num_accepted - self._seen[1]
        self._seen = (num_drafted, num_accepted)
        if drafted <= 0:
            return
        self.rate += self.weight * (accepted / drafted - self.rate)
        if self.rate >= self.min_rate:
            self._next_pause = self.first_pause
            return
        self._pause = self._next_pause
        self._next_pause = min(2 * self._next_pause, self.max_pause)
        self.rate = self.min_rate  # one good step after the pause resumes drafting
