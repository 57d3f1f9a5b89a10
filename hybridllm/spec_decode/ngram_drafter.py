"""The n-gram drafter: before each step, each decoding request's drafts from its own tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.request import Request
from hybridllm.spec_decode.acceptance_guard import AcceptanceGuard
from hybridllm.spec_decode.ngram_index import NgramIndex


@dataclass
class DraftState:
    """What the drafter keeps per request (on `Request.spec_state`, gone with the request)."""

    index: NgramIndex
    guard: AcceptanceGuard


class NgramDrafter:
    """Sets `spec_token_ids` of the running requests that decode next (vLLM's "ngram" method,
    prompt lookup): the tokens that followed the latest earlier occurrence of the request's
    last n tokens in its prompt and output. Drafts cost nothing to make; the scheduler trims
    them to its budget and the last stage keeps those its own sampling agrees with."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(
        self, running: Sequence[Request], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Draft for each request of `running` (not in `skip`: still in flight) whose next step
        computes only its last sampled token."""
        config = self.config
        limit = config.disable_by_batch_size
        batch_too_large = limit is not None and len(running) >= limit
        for request in running:
            if request.request_id in skip:
                continue
            request.spec_token_ids = []
            if batch_too_large or request.num_computed_tokens != request.num_tokens - 1:
                continue
            state = request.spec_state
            if state is None:
                state = request.spec_state = DraftState(
                    NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max),
                    AcceptanceGuard(),
                )
            state.guard.observe(request.num_draft_tokens, request.num_accepted_tokens)
            k = min(
                self._num_to_draft(request), state.guard.draft_length(config.num_speculative_tokens)
            )
            if k <= 0 or not state.guard.should_draft():
                continue
            drafts = state.index.propose(request.all_token_ids, k)
            grammar = request.structured_output
            if drafts and grammar is not None:
                drafts = drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def _num_to_draft(self, request: Request) -> int:
        """At most num_speculative_tokens, and no more than the request may still output after
        the token each step samples anyway."""
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return k
