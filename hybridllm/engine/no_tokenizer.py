"""What a request may not ask of an engine that runs without a tokenizer (skip_tokenizer_init)."""

from __future__ import annotations

from typing import Any

from hybridllm.sampling_params import SamplingParams

TEXT_PROMPT_NEEDS_TOKENIZER = (
    "a text prompt needs a tokenizer, but this engine runs without one "
    "(skip_tokenizer_init=True): pass the prompt as token ids, a list of ints or "
    "{'prompt_token_ids': [...]}"
)
STOP_NEEDS_TOKENIZER = (
    "stop: stop strings need a tokenizer to detokenize the output, but this engine runs "
    "without one (skip_tokenizer_init=True); use stop_token_ids instead"
)


def check_prompt_without_tokenizer(prompt: Any) -> None:
    """Raise ValueError for a prompt that would need tokenizing (text, or a dict without ids)."""
    if isinstance(prompt, str) or (
        isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt
    ):
        raise ValueError(TEXT_PROMPT_NEEDS_TOKENIZER)


def check_params_without_tokenizer(params: SamplingParams) -> None:
    """Raise ValueError for sampling parameters that work on text (stop strings)."""
    if params.stop:
        raise ValueError(STOP_NEEDS_TOKENIZER)
