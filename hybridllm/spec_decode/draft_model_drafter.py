"""The draft-model drafter: a small model with the target's vocabulary guesses the next tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.request import Request
from hybridllm.spec_decode.drafter import Drafter


class DraftRunner(Protocol):
    """What the drafter needs of the draft model (worker/draft_runner.py runs it)."""

    def propose(self, batch: list[tuple[str, list[int], int]]) -> list[list[int]]: ...

    def retain(self, req_ids: set[str]) -> None: ...

    def shutdown(self) -> None: ...


class DraftModelDrafter(Drafter):
    """vLLM's "draft_model" method: the draft model decodes k tokens greedily after each
    request's known tokens, from its own KV cache of the request (it is fed only what it has
    not seen). Its drafts are checked against the request's grammar like any others."""

    def __init__(self, config: SpeculativeConfig, runner: DraftRunner) -> None:
        super().__init__(config)
        self.runner = runner

    def propose(
        self, running: Sequence[Request], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        # the draft's KV of requests that left the running set (finished, preempted) is freed
        self.runner.retain({request.request_id for request in running})
        super().propose(running, skip)

    def draft(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        if not batch:
            return []
        return self.runner.propose(
            [(request.request_id, request.all_token_ids, k) for request, k in batch]
        )

    def shutdown(self) -> None:
        self.runner.shutdown()
