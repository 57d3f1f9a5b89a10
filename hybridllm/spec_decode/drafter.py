"""What every drafter shares: which running requests draft this step, and how many tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.request import Request
from hybridllm.spec_decode.acceptance_guard import AcceptanceGuard


@dataclass
class DraftState:
    """What a drafter keeps per request (on `Request.spec_state`, gone with the request)."""

    guard: AcceptanceGuard


class Drafter:
    """Sets `spec_token_ids` of the running requests that decode next; subclasses say how the
    drafts are made (`draft`). The scheduler trims drafts to its budget and the last stage
    keeps those its own sampling agrees with."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(
        self, running: Sequence[Request], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Draft for each request of `running` (not in `skip`: still in flight) whose next step
        computes only its last sampled token: up to num_speculative_tokens, fewer while its
        acceptance guard says so, none while `disable_by_batch_size` requests or more run."""
        limit = self.config.disable_by_batch_size
        batch_too_large = limit is not None and len(running) >= limit
        batch: list[tuple[Request, int]] = []
        for request in running:
            if request.request_id in skip:
                continue
            request.spec_token_ids = []
            if batch_too_large or request.num_computed_tokens != request.num_tokens - 1:
                continue
            state = request.spec_state
            if state is None:
                state = request.spec_state = self.new_state()
            state.guard.observe(request.num_draft_tokens, request.num_accepted_tokens)
            k = min(
                self._num_to_draft(request),
                self.draft_length(state.guard, self.config.num_speculative_tokens),
            )
            if k > 0 and state.guard.should_draft():
                batch.append((request, k))
        for (request, _), drafts in zip(batch, self.draft(batch), strict=True):
            grammar = request.structured_output
            if drafts and grammar is not None:
                drafts = drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def new_state(self) -> DraftState:
        return DraftState(AcceptanceGuard())

    def draft_length(self, guard: AcceptanceGuard, k: int) -> int:
        """How many of up to `k` drafts a request with this guard verifies next."""
        return guard.draft_length(k)

    def draft(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k) of `batch`."""
        raise NotImplementedError

    def observe(self, output: Any, requests: Mapping[str, Request]) -> None:
        """A step finished with `output` (a ModelRunnerOutput, or None); `requests`: the
        scheduler's requests after it. Drafters that draft from the step's results keep them."""

    def shutdown(self) -> None:
        """Release what the drafter holds (a draft model's weights and KV cache)."""

    def _num_to_draft(self, request: Request) -> int:
        """At most num_speculative_tokens, and no more than the request may still output after
        the token each step samples anyway."""
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return k
