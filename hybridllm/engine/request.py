"""One generation request as the engine core tracks it: tokens, progress, and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import Any

from hybridllm.engine.kv_cache_utils import BlockHash, extend_block_hashes
from hybridllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request; every FINISHED_* status is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop", "length", "abort", "error"), None if unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token ids and progress of one request (one sample: `n > 1` is expanded upstream).

    `num_computed_tokens` (tokens whose KV is in the cache) catches up with
    `num_tokens` (prompt + output); the step where it does samples one more token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        # Prompt + output in one list, grown in place: reading it never copies.
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits when first scheduled
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # stop token id or stop string
        self.error: str | None = None  # why it ended FINISHED_ERROR
        # the request itself caused it (its prompt does not fit, its sampling parameters
        # fail): the error is the client's to read, not an internal one
        self.error_from_request = False
        self.num_preemptions = 0
        # Chained hashes of the full blocks of all_token_ids, extended as tokens arrive.
        self.block_hashes: list[BlockHash] = []
        # structured outputs: its grammar matcher (structured/request_state.py GrammarState),
        # set by the engine; the request waits until the grammar is compiled
        self.structured_output: Any = None
        # speculative decoding: drafts for the next step (set by the drafter, consumed by the
        # scheduler), the drafter's per-request state, and what became of its drafts so far
        self.spec_token_ids: list[int] = []
        self.spec_state: Any = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids (a live view: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hash the full blocks not hashed yet (O(new blocks)) and return all hashes."""
        extend_block_hashes(self.block_hashes, self._all_token_ids, block_size)
        return self.block_hashes

    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
