"""One request's grammar matcher: waits for its compiled grammar, then follows its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any


class GrammarState:
    """Lives in the engine process beside the `Request` (never sent to workers).

    The matcher has consumed exactly the request's output tokens: preemption by recompute keeps
    both (the KV cache is recomputed, the tokens are not resampled), so nothing rolls back.
    A state whose grammar is not compiled yet keeps its request in the waiting queue.
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self.matcher: Any = None
        self.error: str | None = None

    def is_ready(self, output_token_ids: list[int]) -> bool:
        """True once the matcher exists (or compilation failed: see `error`); catches the
        matcher up with `output_token_ids` when it is made."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            self.matcher = self._compiled.result().deep_copy()
        except Exception as exc:  # a GrammarError from the compile thread
            self.error = str(exc)
            return True
        if output_token_ids and not self.matcher.consume_tokens(output_token_ids):
            self.error = "the output so far does not match the grammar"
        return True

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False when the grammar refuses it."""
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def rejection(self, token_id: int) -> str:
        """Why `accept(token_id)` said no: the grammar engine's error (a limit it reached,
        as deep recursion in a schema does) or the token itself."""
        if self.matcher.is_error():
            from hybridllm.structured.backend import short_error

            return f"the grammar failed while generating: {short_error(self.matcher.get_error())}"
        return f"sampled token {token_id} does not match the grammar"

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits no more tokens: the request stops here."""
        return self.matcher.is_stopped()

    def fill_bitmasks(self, bitmask: Any, row: int, drafts: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, words] array, and
        into the rows after it those allowed after each of `drafts` (speculative decoding;
        `num_valid` must have passed them): the matcher ends where it began."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)
        for i, draft in enumerate(drafts, 1):
            self.matcher.consume_token(draft)
            fill_next_token_bitmask(self.matcher, bitmask, row + i)
        if drafts:
            self.matcher.rollback(len(drafts))

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, in order, the grammar accepts from here (nothing consumed)."""
        if self.matcher is None or self.error is not None or self.matcher.is_error():
            return 0
        return self.matcher.validate_tokens(list(drafts))
