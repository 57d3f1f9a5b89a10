"""Per-step sampling tensors, built once from the per-request `SamplingParams` of the batch."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from hybridllm.sample.seeding import make_row_generator
from hybridllm.sampling_params import SamplingParams

# Padding for the ragged token-id tensors of the penalties; mapped to an extra vocab
# column at sampling time (the vocab size is only known once logits exist).
TOKEN_PAD = -1


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything the `Sampler` needs for one step; row i is the i-th request that samples.

    Optional tensors are None when no row uses the feature, so the sampler skips that
    stage entirely. All tensors live on the sampling device; the Python lists are host-side
    bookkeeping that never drive a device sync.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [num_rows] bool; None when all_greedy or all_random
    temperature: torch.Tensor | None  # [num_rows] f32 (1.0 on greedy rows); None if all greedy
    top_k: torch.Tensor | None  # [num_rows] int64, vocab-wide rows hold a huge k; None if unused
    top_p: torch.Tensor | None  # [num_rows] f32; None if unused
    min_p: torch.Tensor | None  # [num_rows] f32; None if unused
    max_top_k: int  # largest enabled top_k (0 when none): lets top-k alone use torch.topk
    needs_batched_draw: bool  # some random row is unseeded (else only per-row generators draw)
    # seeded random rows: row -> generator seeded from (seed, num output tokens)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # logit_bias as a sparse list of (row, token, bias) triples
    bias_rows: torch.Tensor | None = None  # [num_biases] int64
    bias_token_ids: torch.Tensor | None = None  # [num_biases] int64
    bias_values: torch.Tensor | None = None  # [num_biases] f32
    # min_tokens: (row, token) pairs to mask to -inf this step (eos + stop_token_ids)
    min_tokens_rows: torch.Tensor | None = None  # [num_masked] int64
    min_tokens_token_ids: torch.Tensor | None = None  # [num_masked] int64
    # penalties (all None when no row has a penalty)
    repetition_penalties: torch.Tensor | None = None  # [num_rows] f32 (1.0: none)
    frequency_penalties: torch.Tensor | None = None  # [num_rows] f32
    presence_penalties: torch.Tensor | None = None  # [num_rows] f32
    prompt_token_ids: torch.Tensor | None = None  # [num_rows, max_prompt_len] int64, TOKEN_PAD
    output_token_ids: torch.Tensor | None = None  # [num_rows, max_output_len] int64, TOKEN_PAD
    # logprobs: per row the number of top logprobs asked for (None: no logprobs)
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row asks for logprobs
    # structured outputs (sample/grammar_mask.py): rows whose grammar forbids tokens this step
    grammar_rows: torch.Tensor | None = None  # [num_constrained] int64
    grammar_forbidden: torch.Tensor | None = None  # [num_constrained, vocab] bool, True = -inf
    grammar_covers_all_rows: bool = False

    @property
    def no_logit_changes(self) -> bool:
        """True when the logits reach temperature/top-k unchanged (no grammar mask, bias,
        min_tokens or penalty)."""
        return (
            self.grammar_forbidden is None
            and self.bias_rows is None
            and self.min_tokens_rows is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
        *,
        eos_token_ids: Collection[int] = (),
        vocab_size: int | None = None,
    ) -> SamplingMetadata:
        """Build the step's tensors; one row per request that samples this step.

        `eos_token_ids` is the model's set of end-of-sequence ids (tokenizer eos plus any
        from generation_config); `min_tokens` masks them (unless `ignore_eos`) together
        with the request's `stop_token_ids`. `vocab_size`, when given, makes out-of-range
        token ids in `logit_bias`/`stop_token_ids` a clear ValueError instead of a device
        assert inside the sampler.
        """
        num_rows = len(params)
        if len(prompt_token_ids) != num_rows or len(output_token_ids) != num_rows:
            raise ValueError(
                f"SamplingMetadata.build: got {num_rows} params but {len(prompt_token_ids)} "
                f"prompts and {len(output_token_ids)} outputs"
            )
        device = torch.device(device)
        if vocab_size is not None:
            _check_token_ids(params, vocab_size)

        def to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
            # Pinned + non_blocking: a pageable copy would wait for the queued forward pass.
            t = torch.tensor(data, dtype=dtype)
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        random_params = [p for p in params if not p.greedy]

        temperature = top_k = top_p = min_p = greedy_mask = None
        max_top_k = 0
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = to_device(
                [1.0 if p.greedy else p.temperature for p in params], torch.float32
            )
            if not all_random:
                greedy_mask = to_device(greedy, torch.bool)
            if any(p.top_k > 0 for p in random_params):
                # A k this large never masks anything: rows without top-k ride along.
                ks = [p.top_k if p.top_k > 0 and not p.greedy else 1 << 62 for p in params]
                max_top_k = max(p.top_k for p in random_params)
                top_k = to_device(ks, torch.int64)
            if any(p.top_p < 1.0 for p in random_params):
                top_p = to_device([1.0 if p.greedy else p.top_p for p in params], torch.float32)
            if any(p.min_p > 0.0 for p in random_params):
                min_p = to_device([0.0 if p.greedy else p.min_p for p in params], torch.float32)
            for row, p in enumerate(params):
                if p.seed is not None and not p.greedy:
                    generators[row] = make_row_generator(p.seed, len(output_token_ids[row]), device)

        bias = [
            (row, tok, val)
            for row, p in enumerate(params)
            for tok, val in (p.logit_bias or {}).items()
        ]
        bias_rows = bias_token_ids = bias_values = None
        if bias:
            rows, toks, vals = zip(*bias, strict=True)
            bias_rows = to_device(list(rows), torch.int64)
            bias_token_ids = to_device([int(t) for t in toks], torch.int64)
            bias_values = to_device(list(vals), torch.float32)

        masked = []
        for row, p in enumerate(params):
            if len(output_token_ids[row]) < p.min_tokens:
                stop_ids = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stop_ids |= set(eos_token_ids)
                masked.extend((row, tok) for tok in sorted(stop_ids))
        min_tokens_rows = min_tokens_token_ids = None
        if masked:
            min_tokens_rows = to_device([r for r, _ in masked], torch.int64)
            min_tokens_token_ids = to_device([t for _, t in masked], torch.int64)

        penalties: dict[str, torch.Tensor | None] = dict.fromkeys(
            (
                "repetition_penalties",
                "frequency_penalties",
                "presence_penalties",
                "prompt_token_ids",
                "output_token_ids",
            )
        )
        if any(p.needs_penalties for p in params):
            penalties["repetition_penalties"] = to_device(
                [p.repetition_penalty for p in params], torch.float32
            )
            penalties["frequency_penalties"] = to_device(
                [p.frequency_penalty for p in params], torch.float32
            )
            penalties["presence_penalties"] = to_device(
                [p.presence_penalty for p in params], torch.float32
            )
            penalties["prompt_token_ids"] = to_device(_pad(prompt_token_ids), torch.int64)
            penalties["output_token_ids"] = to_device(_pad(output_token_ids), torch.int64)

        num_logprobs = [p.logprobs for p in params]
        asked = [k for k in num_logprobs if k is not None]
        return cls(
            num_rows=num_rows,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_top_k=max_top_k,
            needs_batched_draw=any(p.seed is None for p in random_params),
            generators=generators,
            bias_rows=bias_rows,
            bias_token_ids=bias_token_ids,
            bias_values=bias_values,
            min_tokens_rows=min_tokens_rows,
            min_tokens_token_ids=min_tokens_token_ids,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            **penalties,
        )


def _pad(token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Ragged rows -> rectangular rows padded with TOKEN_PAD (at least one column)."""
    width = max(1, max((len(ids) for ids in token_ids), default=0))
    return [list(ids) + [TOKEN_PAD] * (width - len(ids)) for ids in token_ids]


def _check_token_ids(params: Sequence[SamplingParams], vocab_size: int) -> None:
    for p in params:
        for tok in p.logit_bias or {}:
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(
                    f"SamplingParams.logit_bias has token id {tok} outside the vocab "
                    f"[0, {vocab_size})"
                )
        for tok in p.stop_token_ids:
            if tok >= vocab_size:
                raise ValueError(
                    f"SamplingParams.stop_token_ids has token id {tok} outside the vocab "
                    f"[0, {vocab_size})"
                )
