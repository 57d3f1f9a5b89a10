"""Logit adjustments before temperature: logit_bias, min_tokens, and the three penalties."""

from __future__ import annotations

import torch

from hybridllm.sample.sampling_metadata import TOKEN_PAD, SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each row's `logit_bias` in place; logits [num_rows, vocab]."""
    if metadata.bias_rows is None:
        return
    logits.index_put_(
        (metadata.bias_rows, metadata.bias_token_ids), metadata.bias_values, accumulate=True
    )


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Forbid eos/stop tokens in rows that have not yet produced `min_tokens` tokens."""
    if metadata.min_tokens_rows is None:
        return
    neg_inf = logits.new_full((), float("-inf"))  # a fill kernel, not a host->device copy
    logits.index_put_((metadata.min_tokens_rows, metadata.min_tokens_token_ids), neg_inf)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts of each token: [num_rows, len] ids -> [num_rows, vocab] int."""
    num_rows = token_ids.shape[0]
    # Padding goes to an extra column that is dropped, so no masking is needed.
    index = torch.where(token_ids == TOKEN_PAD, vocab_size, token_ids)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Repetition (HF), then frequency and presence (OpenAI) penalties, in place.

    Repetition: a token seen in prompt or output has its logit divided by the penalty when
    positive and multiplied when negative. Frequency/presence: subtract
    `frequency * count + presence * (count > 0)` over the output tokens only.
    """
    if metadata.repetition_penalties is None:
        return
    vocab_size = logits.shape[-1]
    output_counts = token_counts(metadata.output_token_ids, vocab_size)  # [num_rows, vocab]
    prompt_counts = token_counts(metadata.prompt_token_ids, vocab_size)  # [num_rows, vocab]
    seen = (output_counts > 0) | (prompt_counts > 0)  # [num_rows, vocab]

    rep = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)  # [num_rows, vocab]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))

    freq = metadata.frequency_penalties.unsqueeze(1)  # [num_rows, 1]
    presence = metadata.presence_penalties.unsqueeze(1)  # [num_rows, 1]
    logits.sub_(freq * output_counts + presence * (output_counts > 0))
