"""The draft-model drafter: a small model with the target's vocabulary guesses the next tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.request import Request
from hybridllm.spec_decode.acceptance_guard import AcceptanceGuard
from hybridllm.spec_decode.drafter import Drafter, DraftState


class DraftRunner(Protocol):
    """What the drafter needs of the draft model (worker/draft_runner.py runs it)."""

    def propose(self, batch: list[tuple[str, list[int], int]]) -> list[list[int]]: ...

    def retain(self, req_ids: set[str]) -> None: ...

    @property
    def num_tokens_run(self) -> int: ...

    def shutdown(self) -> None: ...


class DraftModelDrafter(Drafter):
    """vLLM's "draft_model" method: the draft model decodes k tokens greedily after each
    request's known tokens, from its own KV cache of the request (it is fed only what it has
    not seen). Its drafts are checked against the request's grammar like any others.

    Unlike n-grams, drafts cost time. The drafter measures a draft forward (`draft_seconds`),
    a plain decode step and a verify step of the target (the time between two calls, less the
    drafting: `plain_seconds`, `verify_seconds`), and from them the cost of one more draft in
    plain steps, c = (draft forward + a verify step's extra per draft) / plain step. Each
    request verifies the k that maximises expected tokens a second at its acceptance rate a,
    (1 - a^(k+1)) / (1 - a) tokens for 1 + k c steps' time, and its guard pauses drafting below
    a = c + MARGIN (at a = c a single draft only breaks even). Where even drafts that are
    always kept would not pay (c near 1 or above: a draft model about as slow as the target)
    nothing is drafted.
    """

    # the running averages' weight of the latest measurement
    WEIGHT = 0.2
    # acceptance above break-even a request needs to go on drafting
    MARGIN = 0.15
    # no drafts at all where even always-kept drafts would gain less than this
    MIN_GAIN = 0.05

    def __init__(self, config: SpeculativeConfig, runner: DraftRunner) -> None:
        super().__init__(config)
        self.runner = runner
        self.draft_seconds: float | None = None  # one draft forward
        self.plain_seconds: float | None = None  # a decode step without drafts, and around it
        self.verify_seconds: float | None = None  # a step that verified drafts
        self.verify_drafts: float | None = None  # drafts of the longest request of such steps
        self._last: tuple[bool, float, int] | None = None  # (drafted, end, drafts) of a call
        # False: drafts are priced as free (the acceptance guard alone; tests of the drafting
        # itself, whose counts must not depend on the machine's timings)
        self.price_drafts = True

    def new_state(self) -> DraftState:
        # a draft that fails costs its forwards, and a retry after a pause first catches the
        # draft up with the tokens it missed: pause longer than the n-gram drafter does
        return DraftState(AcceptanceGuard(first_pause=16, max_pause=128))

    def propose(
        self, running: Sequence[Request], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        start = time.perf_counter()
        if self._last is not None:
            drafted, end, drafts = self._last
            gap = start - end
            average = self.verify_seconds if drafted else self.plain_seconds
            if average is None or gap < 4 * average:  # an idle engine's gap is not a step
                if drafted:
                    self.verify_seconds = _average(self.verify_seconds, gap, self.WEIGHT)
                    self.verify_drafts = _average(self.verify_drafts, drafts, self.WEIGHT)
                else:
                    self.plain_seconds = _average(self.plain_seconds, gap, self.WEIGHT)
        # the draft's KV of requests that left the running set (finished, preempted) is freed
        self.runner.retain({request.request_id for request in running})
        # only steps of decoding requests measure a step (a prompt's chunk is not one)
        decoding = bool(running) and all(
            r.num_computed_tokens == r.num_tokens - 1 and r.request_id not in skip for r in running
        )
        tokens = self.runner.num_tokens_run
        super().propose(running, skip)
        drafts = max((len(r.spec_token_ids) for r in running), default=0)
        drafted = self.runner.num_tokens_run > tokens and drafts > 0
        self._last = (drafted, time.perf_counter(), drafts) if decoding else None

    @property
    def cost_ratio(self) -> float:
        """One more draft's time in plain steps (0 until a draft and a step are measured)."""
        plain = self.plain_seconds or self.verify_seconds
        if not self.price_drafts or not self.draft_seconds or not plain:
            return 0.0
        extra = 0.0  # what a verify step costs beyond a plain one, a draft
        if self.verify_seconds and self.plain_seconds and self.verify_drafts:
            extra = max(0.0, (self.verify_seconds - self.plain_seconds) / self.verify_drafts)
        return (self.draft_seconds + extra) / plain

    def draft_length(self, guard: AcceptanceGuard, k: int) -> int:
        ratio = self.cost_ratio
        # where one draft breaks even, with a margin: the rate is a noisy running estimate
        guard.min_rate = min(0.95, max(0.4, ratio + self.MARGIN))
        if max((n + 1) / (1 + n * ratio) for n in range(1, k + 1)) < 1 + self.MIN_GAIN:
            return 0  # even drafts that are always right would not pay for their forwards
        rate = min(guard.rate, 0.999)
        best, best_gain = 1, 0.0
        for n in range(1, k + 1):
            gain = (1 - rate ** (n + 1)) / (1 - rate) / (1 + n * ratio)
            if gain > best_gain:
                best, best_gain = n, gain
        return best

    def draft(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        if not batch:
            return []
        start, tokens = time.perf_counter(), self.runner.num_tokens_run
        drafts = self.runner.propose(
            [(request.request_id, request.all_token_ids, k) for request, k in batch]
        )
        forwards = max(k for _, k in batch)  # one a draft position, the requests batched
        # a call that caught up a prompt is a prefill, not what a draft step costs
        if self.runner.num_tokens_run - tokens <= len(batch) * (forwards + 1):
            seconds = (time.perf_counter() - start) / forwards
            self.draft_seconds = _average(self.draft_seconds, seconds, self.WEIGHT)
        return drafts

    def shutdown(self) -> None:
        self.runner.shutdown()


def _average(average: float | None, value: float, weight: float) -> float:
    return value if average is None else average + weight * (value - average)
