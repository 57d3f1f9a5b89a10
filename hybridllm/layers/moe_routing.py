"""Mixture-of-experts routing: router scores, top-k experts per token, and tokens grouped by expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights, in fp32 whatever the logits' dtype.

    `router_logits` [num_tokens, num_experts] -> (weights [num_tokens, top_k] float32,
    expert ids [num_tokens, top_k] int64), best first. Scores are the softmax over all experts
    (Mixtral, Qwen-MoE, OLMoE) or each logit's sigmoid (DeepSeek-V3 style); `renormalize`
    divides the selected scores by their sum.
    """
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"MoE scoring must be one of {SCORING_FUNCTIONS}, got {scoring!r}")
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, ids = torch.topk(scores, top_k, dim=-1)  # [n, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, slot) pairs of a batch sorted by expert, so each expert sees its rows together.

    `order` [num_tokens * top_k] indexes the flattened [num_tokens, top_k] selection: pairs of
    expert e are `order[offsets[e]:offsets[e + 1]]`; `token_ids = order // top_k` are their rows
    of the input, and `inverse` puts grouped rows back in (token, slot) order. `counts` (a Python list: the loop over experts needs it on the host) has
    one entry per expert; `active` lists the experts with at least one token.
    """

    order: torch.Tensor
    token_ids: torch.Tensor
    inverse: torch.Tensor
    counts: list[int]
    offsets: list[int]

    @property
    def active(self) -> list[int]:
        return [e for e, count in enumerate(self.counts) if count]


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort `expert_ids` [num_tokens, top_k] into per-expert runs (stable: tokens in order)."""
    top_k = expert_ids.shape[-1]
    flat = expert_ids.reshape(-1)  # [n * k]
    order = torch.argsort(flat, stable=True)  # [n * k]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return ExpertGroups(order, order // top_k, inverse, counts, offsets)
