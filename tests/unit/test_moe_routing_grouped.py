"""DeepSeek's group-limited routing against transformers' own routers."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from hybridllm.layers.moe_routing import GroupLimitedRouting, select_experts_grouped

E = 16


def hf_router(router_class, config):
    router = router_class(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))  # the router's logits are its input
    return router


def sorted_by_expert(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
def test_v3_routing_equals_transformers(groups, renormalize):
    n_group, topk_group = groups
    config = transformers.DeepseekV3Config(
        hidden_size=E, n_routed_experts=E, num_experts_per_tok=4, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = hf_router(DeepseekV3TopkRouter, config)
    bias = 0.3 * torch.randn(E)
    router.e_score_correction_bias.copy_(bias)
    logits = torch.randn(64, E)
    _, want_w, want_ids = router(logits)
    grouping = GroupLimitedRouting(n_group, topk_group, "top2_sum", 2.5, correction_bias=True)
    got_w, got_ids = select_experts_grouped(logits, 4, "sigmoid", renormalize, grouping, bias)
    want_w, want_ids = sorted_by_expert(want_w, want_ids)
    got_w, got_ids = sorted_by_expert(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    # the bias chose: without it some tokens pick other experts
    plain = GroupLimitedRouting(n_group, topk_group, "top2_sum", 2.5)
    _, unbiased_ids = sorted_by_expert(
        *select_experts_grouped(logits, 4, "sigmoid", renormalize, plain)
    )
    assert not torch.equal(unbiased_ids, got_ids)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_equals_transformers(method):
    config = transformers.DeepseekV2Config(
        hidden_size=E, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
        num_experts_per_tok=3, n_group=4, topk_group=2, topk_method=method,
        routed_scaling_factor=1.5,
    )  # fmt: skip
    router = hf_router(DeepseekV2TopkRouter, config)
    logits = torch.randn(64, E)
    _, want_w, want_ids = router(logits)
    groups = (4, 2) if method == "group_limited_greedy" else (1, 1)
    grouping = GroupLimitedRouting(*groups, "max", 1.5)
    got_w, got_ids = select_experts_grouped(logits, 3, "softmax", False, grouping)
    want_w, want_ids = sorted_by_expert(want_w, want_ids)
    got_w, got_ids = sorted_by_expert(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_bad_groupings_are_refused():
    with pytest.raises(ValueError, match="topk_group 3 must be in"):
        GroupLimitedRouting(2, 3)
    with pytest.raises(ValueError, match="does not divide"):
        GroupLimitedRouting(3, 1).check(16, 2)
    with pytest.raises(ValueError, match="exceeds"):
        GroupLimitedRouting(8, 1).check(16, 4)
