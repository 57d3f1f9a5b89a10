"""The n-gram drafter: before each step, each decoding request's drafts from its own tokens."""

from __future__ import annotations

from dataclasses import dataclass

from hybridllm.engine.request import Request
from hybridllm.spec_decode.acceptance_guard import AcceptanceGuard
from hybridllm.spec_decode.drafter import Drafter, DraftState
from hybridllm.spec_decode.ngram_index import NgramIndex


@dataclass
class NgramState(DraftState):
    index: NgramIndex | None = None
    # where the last drafts were copied from, and the request's length then: while the tokens
    # since keep following that source, the next drafts continue it (see `source_of`)
    source: int | None = None
    length_then: int = 0


class NgramDrafter(Drafter):
    """vLLM's "ngram" method, prompt lookup: the continuation of the passage the request is
    copying while it still follows it, else the tokens that followed the latest earlier
    occurrence of its last n tokens in its prompt and output. Drafts cost nothing to make."""

    def new_state(self) -> NgramState:
        config = self.config
        return NgramState(
            AcceptanceGuard(), NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        )

    def draft(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        result = []
        for request, k in batch:
            state = request.spec_state
            token_ids = request.all_token_ids
            start = self.source_of(state, token_ids)
            state.source, state.length_then = start, len(token_ids)
            result.append([] if start is None else token_ids[start : start + k])
        return result

    def source_of(self, state: NgramState, token_ids: list[int]) -> int | None:
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
