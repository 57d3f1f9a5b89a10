"""Per-request sampling parameters, validated once at construction (no torch import)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

from hybridllm.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_N = 1024  # samples per request: each is a sequence of its own; millions exhaust memory
_SEED_MIN = -(1 << 63)  # seeds are taken modulo 2**64: int64 and uint64 values both fit
_SEED_END = 1 << 64
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class SamplingParams:
    """How to pick tokens for one request; mirrors vLLM's `SamplingParams` fields.

    Invalid values raise `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: sampled only)
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # the output must match a JSON schema, regex, choice or grammar (hybridllm/structured/)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"SamplingParams.{name} must be a list, got {type(value).__name__}"
                )
            setattr(self, name, list(value or []))
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return ValueError(f"SamplingParams.{name} {why}, got {shown}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_finite(value: object) -> bool:
            # bool is an int to Python, never a sampling parameter to a user.
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        for name in _FLOAT_FIELDS:
            if not is_finite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise bad(name, "must be an integer >= 0")
        if self.seed is not None and (
            not is_int(self.seed) or not _SEED_MIN <= self.seed < _SEED_END
        ):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for token_id, bias in self.logit_bias.items():
                if not is_int(token_id) or token_id < 0:
                    raise bad(
                        "logit_bias", f"keys must be token ids (integers >= 0), not {token_id!r}"
                    )
                if not is_finite(bias):
                    raise bad("logit_bias", f"values must be finite numbers, not {bias!r}")

    def verify_for_model(self, vocab_size: int) -> SamplingParams:
        """Check the token ids against the model's vocabulary; returns the params to run.

        A top_k or logprobs count at or above the vocabulary is "all of it": top_k becomes
        0 (no limit, as in vLLM), so the sampler never sees a k it cannot hold.
        """

        def outside(name: str, token_id: int) -> ValueError:
            return ValueError(
                f"SamplingParams.{name} has token id {token_id}, outside the vocabulary "
                f"[0, {vocab_size})"
            )

        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise outside("stop_token_ids", token_id)
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise outside("logit_bias", token_id)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(
                    f"SamplingParams.{name} must be <= the vocabulary size {vocab_size}, "
                    f"got {value}"
                )
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=0)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Params for the index-th of `n` samples: n=1, and a distinct seed when seeded."""
        seed = self.seed
        if seed is not None and index > 0:
            seed = derive_sample_seed(seed, index)
        kwargs = {f: getattr(self, f) for f in self.__dataclass_fields__}
        kwargs.update(n=1, seed=seed)
        return SamplingParams(**kwargs)


def derive_sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` (> 0) of a seeded request with `n` > 1, in [0, 2**64).

    A hash, not `seed + index`: sample 1 of seed 7 must not be sample 0 of seed 8.
    """
    data = f"{seed % _SEED_END}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
