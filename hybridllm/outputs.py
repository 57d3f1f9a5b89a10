"""User-facing results of generation, shaped like vLLM's `RequestOutput` (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability at one position, its rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` samples of a request. Text and token ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, like vLLM)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request failed (finish_reason "error")
    # the failure was the request's own (a prompt that does not fit, sampling parameters that
    # fail): `error` is for the client; otherwise it is internal
    error_from_request: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
