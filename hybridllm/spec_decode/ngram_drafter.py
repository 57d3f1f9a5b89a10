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
    # where the last drafts were copied from, and the request's length then: while the tokens
    # since keep following that source, the next drafts continue it (see `source_of`)
    source: int | None = None
    length_then: int = 0


class NgramDrafter:
    """Sets `spec_token_ids` of the running requests that decode next (vLLM's "ngram" method,
    prompt lookup): the continuation of the passage the request is copying while it still
    follows it, else the tokens that followed the latest earlier occurrence of its last n
    tokens in its prompt and output. Drafts cost nothing to make; the scheduler trims them to
    its budget and the last stage keeps those its own sampling agrees with."""

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
            token_ids = request.all_token_ids
            start = self.source_of(state, token_ids)
            state.source, state.length_then = start, len(token_ids)
            drafts = [] if start is None else token_ids[start : start + k]
            grammar = request.structured_output
            if drafts and grammar is not None:
                drafts = drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def source_of(self, state: DraftState, token_ids: list[int]) -> int | None:
        """Where to copy the next drafts from: the last source moved on by the tokens added
        since, when the last min_n of them match it (the request is still copying that passage,
        whose aligned continuation beats the latest occurrence of a common n-gram); else the
        index's latest earlier occurrence of the suffix."""
        if state.source is not None:
            cursor = state.source + len(token_ids) - state.length_then
            n = self.config.prompt_lookup_min
            if n <= cursor < len(token_ids) and token_ids[cursor - n : cursor] == token_ids[-n:]:
                return cursor  # the index catches up with these tokens at its next lookup
        return state.index.lookup(token_ids)

    def _num_to_draft(self, request: Request) -> int:
        """At most num_speculative_tokens, and no more than the request may still output after
        the token each step samples anyway."""
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return k
