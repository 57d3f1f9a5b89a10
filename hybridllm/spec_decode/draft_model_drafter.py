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

    Unlike n-grams, drafts cost time: a draft forward (`draft_seconds`, measured) beside the
    target's step (`step_seconds`: the time between two calls, less the drafting). Each
    request drafts the k that maximises expected tokens a second at its acceptance rate a,
    (1 - a^(k+1)) / (1 - a) tokens for step + k draft forwards, and its guard pauses drafting
    below the rate where one draft pays for itself (a = draft / step), so drafts that do not
    pay are not made.
    """

    # the running averages' weight of the latest measurement
    WEIGHT = 0.2

    def __init__(self, config: SpeculativeConfig, runner: DraftRunner) -> None:
        super().__init__(config)
        self.runner = runner
        self.draft_seconds: float | None = None  # one draft forward
        self.step_seconds: float | None = None  # the target's step and the engine around it
        self._last_end: float | None = None  # of the last call that drafted

    def new_state(self) -> DraftState:
        # a draft that fails costs its forwards, and a retry after a pause first catches the
        # draft up with the tokens it missed: pause longer than the n-gram drafter does
        return DraftState(AcceptanceGuard(first_pause=16, max_pause=128))

    def propose(
        self, running: Sequence[Request], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        start = time.perf_counter()
        if self._last_end is not None:
            # the step that verified the last drafts; an idle engine's gap is not a step
            gap = start - self._last_end
            if self.step_seconds is None or gap < 4 * self.step_seconds:
                self.step_seconds = _average(self.step_seconds, gap, self.WEIGHT)
        # the draft's KV of requests that left the running set (finished, preempted) is freed
        self.runner.retain({request.request_id for request in running})
        drafted = self.runner.num_tokens_run
        super().propose(running, skip)
        drafted = self.runner.num_tokens_run > drafted
        self._last_end = time.perf_counter() if drafted else None

    @property
    def cost_ratio(self) -> float:
        """A draft forward's time over a step's (0 until both are measured)."""
        if not self.draft_seconds or not self.step_seconds:
            return 0.0
        return self.draft_seconds / self.step_seconds

    def draft_length(self, guard: AcceptanceGuard, k: int) -> int:
        ratio = self.cost_ratio
        guard.min_rate = min(0.95, max(0.4, ratio))  # where one draft breaks even
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
