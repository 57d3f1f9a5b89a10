"""Mixtral: the Mistral decoder with a softmax top-k router over SiLU experts in every layer."""

from __future__ import annotations

import re
from typing import Any

from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeSpec, expert_count

# Mixtral checkpoints name their experts' projections w1 (gate), w3 (up) and w2 (down)
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


class MixtralDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        # the top-k softmax weights are renormalised (a softmax over the selected logits)
        return MoeSpec(
            num_experts=expert_count(hf_config, 8),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
        )


class MixtralForCausalLM(MoeForCausalLM):
    """Checkpoint names `block_sparse_moe.{gate,experts.N.w1}` read as `mlp.{gate,experts.N.gate_proj}`."""

    decoder_layer_class = MixtralDecoderLayer

    def normalize_weight_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _EXPERT_NAME.sub(lambda m: f".experts.{m[1]}.{_EXPERT_PARTS[m[2]]}.", name)
        return super().normalize_weight_name(name)
