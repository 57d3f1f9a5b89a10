"""Which drafted tokens a verify step keeps: those its own sampling agrees with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def accepted_length(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of `drafts` to keep, given the tokens sampled at the row before each draft
    and after the last one (`sampled`: len(drafts) + 1 tokens, row j sampled with drafts[:j]
    taken as the request's output): the request then gets sampled[: kept + 1].

    Row j's token is drawn exactly as plain decoding would draw it after drafts[:j] (the same
    processors, and for a seeded request the same per-position generator), so keeping a draft
    while it equals the token drawn at its position gives exactly plain decoding's output:
    greedy outputs are identical, seeded ones too, and unseeded ones follow the target
    distribution. For a draft chosen without randomness (n-gram lookup, a greedy draft model)
    this is the speculative-sampling rule itself: the draft is kept with probability p(draft),
    and on rejection the drawn token follows p without the draft, renormalised.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}"
        )
    kept = 0
    while kept < len(drafts) and sampled[kept] == drafts[kept]:
        kept += 1
    return kept


def group_by_request(keys: Sequence[str], values: Sequence[T]) -> dict[str, list[T]]:
    """Consecutive rows of one request together, in row order: key -> its values."""
    grouped: dict[str, list[T]] = {}
    for key, value in zip(keys, values, strict=True):
        grouped.setdefault(key, []).append(value)
    return grouped
