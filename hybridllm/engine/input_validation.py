"""The checks of a request's prompt and sampling parameters against the loaded model (no torch).

`LLM` (through `LLMEngine.add_request`), the OpenAI server and the scheduler all call these, so
that a request is refused for the same reason, in the same words, whichever way it came in.

The context boundary: prompt plus output tokens never exceed `max_model_len`, and a request
always generates at least one token, so a prompt may have at most `max_model_len - 1` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridllm.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for these refusals


class InvalidInputError(ValueError):
    """A request the model cannot run; `param` names the request field, `code` is OpenAI's
    error code when it has one (the server answers 400 with both)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class InputValidator:
    """The limits of one model and the checks of a request against them.

    `vocab_size` None (a scheduler built without a model) checks token ids for type only.
    """

    max_model_len: int
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    def check_request(
        self, token_ids: Sequence[int], params: SamplingParams, param: str = "prompt"
    ) -> SamplingParams:
        """`check_params`, then `check_prompt`; returns the params to run."""
        params = self.check_params(params)
        self.check_prompt(token_ids, param)
        return params

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """A prompt to generate from: not empty, room left for one output token, every id in
        the vocabulary. `param` names the request field in the message."""
        if len(token_ids) == 0:
            raise InvalidInputError(f"{param} must not be empty", param)
        if len(token_ids) >= self.max_model_len:
            raise InvalidInputError(
                f"this model's maximum context length is max_model_len={self.max_model_len} "
                f"tokens, but the {param} has {len(token_ids)} tokens (at least one token must "
                "be left for the output)",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        self.check_token_ids(token_ids, param)

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Every id an integer (not a bool) and, when the vocabulary is known, inside it."""
        # The common case at C speed: a long prompt is checked in well under a millisecond.
        if len(token_ids) == 0 or (
            set(map(type, token_ids)) == {int}
            and min(token_ids) >= 0
            and (self.vocab_size is None or max(token_ids) < self.vocab_size)
        ):
            return
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                shown = repr(token_id)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise InvalidInputError(f"{param} has {shown}, which is not a token id", param)
            if token_id < 0 or (self.vocab_size is not None and token_id >= self.vocab_size):
                where = (
                    "a negative one"
                    if self.vocab_size is None
                    else f"outside the vocabulary [0, {self.vocab_size})"
                )
                raise InvalidInputError(f"{param} has token id {token_id}, {where}", param)

    def output_budget(
        self, num_prompt_tokens: int, requested: int | None, param: str = "max_tokens"
    ) -> int:
        """The output tokens a prompt may ask for: `requested`, or all the room left when it is
        None; asking for more than the room is refused (the server's rule; `LLM` lets the
        length cap end such a request instead)."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise InvalidInputError(
                f"this model's maximum context length is max_model_len={self.max_model_len} "
                f"tokens, but {num_prompt_tokens + requested} were requested "
                f"({num_prompt_tokens} in the prompt, {requested} for the output); lower {param}",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Sampling parameters against the vocabulary (ValueError naming `SamplingParams.x`);
        returns the params to run, which may differ (a top_k past the vocabulary: no limit)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.vocab_size is None:
            return params
        return params.verify_for_model(self.vocab_size)
