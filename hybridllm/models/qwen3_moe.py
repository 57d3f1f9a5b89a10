"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 decoder (q/k norm) with routed experts."""

from __future__ import annotations

from typing import Any

from hybridllm.models.moe import (
    MoeDecoderLayer,
    MoeForCausalLM,
    MoeSpec,
    expert_count,
    qwen_dense_layers,
)


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=expert_count(hf_config, 128),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            renormalize=bool(hf_config.norm_topk_prob),
            dense_layers=qwen_dense_layers(hf_config),
        )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, True

    def _check_config(self, hf_config: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen3-MoE with use_sliding_window=True is not supported")
