"""Logprobs of chosen tokens (rank + top-k) for sampled and prompt tokens, and their host form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridllm.engine.scheduler_output import Logprobs

# Prompt positions per log_softmax chunk: bounds the [chunk, vocab] float32 temporaries.
_PROMPT_CHUNK = 512


@dataclass(frozen=True)
class LogprobsTensors:
    """Device-side logprobs of one token per row plus the row's top-k (k = max asked)."""

    token_ids: torch.Tensor  # [num_rows] int64: the chosen token
    token_logprobs: torch.Tensor  # [num_rows] f32
    token_ranks: torch.Tensor  # [num_rows] int64, 1 = most likely
    topk_token_ids: torch.Tensor  # [num_rows, k] int64
    topk_logprobs: torch.Tensor  # [num_rows, k] f32

    def to_list(self, num_logprobs: Sequence[int | None]) -> list[Logprobs | None]:
        """Host form: per row the chosen token first, then its top `num_logprobs[row]`.

        Rows asking for no logprobs (None) give None. This is the one host sync.
        """
        token_ids = self.token_ids.tolist()
        token_logprobs = self.token_logprobs.tolist()
        token_ranks = self.token_ranks.tolist()
        topk_ids = self.topk_token_ids.tolist()
        topk_logprobs = self.topk_logprobs.tolist()
        result: list[Logprobs | None] = []
        for row, k in enumerate(num_logprobs):
            if k is None:
                result.append(None)
                continue
            top_values = topk_logprobs[row][:k]
            result.append(
                Logprobs(
                    token_ids=[token_ids[row], *topk_ids[row][:k]],
                    logprobs=[token_logprobs[row], *top_values],
                    ranks=[token_ranks[row], *_descending_ranks(top_values)],
                )
            )
        return result


def _descending_ranks(values: list[float]) -> list[int]:
    """Ranks of descending values, ties sharing the better rank (as `gather_logprobs` does)."""
    ranks: list[int] = []
    for i, value in enumerate(values):
        ranks.append(ranks[-1] if i and value == values[i - 1] else i + 1)
    return ranks


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """From full logprobs [num_rows, vocab]: the chosen tokens' logprob, rank and the top-k."""
    token_ids = token_ids.to(torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    # Rank = 1 + number of strictly more likely tokens (ties share the better rank).
    token_ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    k = min(k, logprobs.shape[-1])
    if k > 0:
        topk_logprobs, topk_token_ids = logprobs.topk(k, dim=-1)
    else:
        topk_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        topk_token_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsTensors(
        token_ids=token_ids,
        token_logprobs=token_logprobs.squeeze(1),
        token_ranks=token_ranks,
        topk_token_ids=topk_token_ids,
        topk_logprobs=topk_logprobs,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """Logprob/rank of each actual next prompt token and the top-k, per prompt position.

    logits [n, vocab] are the raw logits at prompt positions; next_token_ids [n] are the
    tokens that follow them. Processed in chunks so a long prompt does not materialize
    several [n, vocab] float32 temporaries at once.
    """
    if logits.shape[0] != next_token_ids.shape[0]:
        raise ValueError(
            f"compute_prompt_logprobs: {logits.shape[0]} logit rows but "
            f"{next_token_ids.shape[0]} next tokens"
        )
    chunks = [
        gather_logprobs(
            torch.log_softmax(logits[start : start + _PROMPT_CHUNK].float(), dim=-1),
            next_token_ids[start : start + _PROMPT_CHUNK],
            k,
        )
        for start in range(0, max(logits.shape[0], 1), _PROMPT_CHUNK)
    ]
    if len(chunks) == 1:
        return chunks[0]
    return LogprobsTensors(
        token_ids=torch.cat([c.token_ids for c in chunks]),
        token_logprobs=torch.cat([c.token_logprobs for c in chunks]),
        token_ranks=torch.cat([c.token_ranks for c in chunks]),
        topk_token_ids=torch.cat([c.topk_token_ids for c in chunks]),
        topk_logprobs=torch.cat([c.topk_logprobs for c in chunks]),
    )
