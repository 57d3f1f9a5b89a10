"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

from hybridllm.models.moe import (
    MoeDecoderLayer,
    MoeForCausalLM,
    MoeSpec,
    expert_count,
    qwen_dense_layers,
)


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=expert_count(hf_config, 60),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            renormalize=bool(hf_config.norm_topk_prob),
            shared_intermediate_size=int(hf_config.shared_expert_intermediate_size or 0),
            dense_layers=qwen_dense_layers(hf_config),  # their MLP is intermediate_size wide
        )


class Qwen2MoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = Qwen2MoeDecoderLayer

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False, False

    def _check_config(self, hf_config: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen2-MoE with use_sliding_window=True is not supported")
