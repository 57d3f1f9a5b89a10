"""Mixture-of-experts routing: router scores, top-k experts per token, and tokens grouped by expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")


@dataclass(frozen=True)
class GroupLimitedRouting:
    """DeepSeek's routing on top of the scores: experts are split into `num_groups` groups, a
    token keeps its best `topk_groups` groups (a group scored by the sum of its top two scores,
    DeepSeek-V3, or its best one, V2's "group_limited_greedy") and picks its experts among them;
    `correction_bias` (V3's `e_score_correction_bias`, added to the scores only to choose) and
    `scaling_factor` (`routed_scaling_factor`, multiplied into the chosen weights)."""

    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"
    scaling_factor: float = 1.0
    correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_group {self.topk_groups} must be in [1, n_group = {self.num_groups}]"
            )

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise where the groups cannot hold the experts or the top-k."""
        if num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} does not divide {num_experts} experts")
        per_group = num_experts // self.num_groups
        if self.group_score == "top2_sum" and self.num_groups > 1 and per_group < 2:
            raise ValueError(
                "group-limited routing scores groups by their top two experts: "
                f"each of the {self.num_groups} groups holds {per_group}"
            )
        if top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k {top_k} exceeds the {self.topk_groups} kept groups' "
                f"{self.topk_groups * per_group} experts"
            )


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


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    grouping: GroupLimitedRouting,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` with DeepSeek's group limit, choice bias and scaling (fp32 throughout).

    `correction_bias` [E] is added to the scores to choose experts; the weights are the
    unbiased scores of the chosen ones."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if grouping.num_groups > 1:
        groups = choice.view(num_tokens, grouping.num_groups, -1)  # [n, G, E / G]
        if grouping.group_score == "top2_sum":
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [n, G]
        else:
            group_scores = groups.max(dim=-1).values
        kept = torch.topk(group_scores, grouping.topk_groups, dim=-1).indices  # [n, topk_groups]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~mask[:, :, None], float("-inf")).view(num_tokens, -1)
    ids = torch.topk(choice, top_k, dim=-1).indices  # [n, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if grouping.scaling_factor != 1.0:
        weights = weights * grouping.scaling_factor
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
