"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): OLMoE's attention (q and k normed across all their
heads) rotating a part of each head, and routed SiLU experts in every layer chosen by a sigmoid
router with a score-correction bias (DeepSeek-V3's routing with one group), no shared expert.

Checkpoints name the block `block_sparse_moe` with Mixtral's `experts.N.w1/w2/w3` and the bias
`block_sparse_moe.e_score_correction_bias`; transformers 5's state dict says `mlp` and stacks.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridllm.layers.moe_routing import GroupLimitedRouting
from hybridllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters, rotary_dim
from hybridllm.models.mixtral import MixtralForCausalLM
from hybridllm.models.moe import MoeDecoderLayer, MoeSpec
from hybridllm.models.olmoe import OlmoeAttention


def minimax_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings with the rotated part as `partial_rotary_factor` (released checkpoints
    give it as `rotary_dim`)."""
    params = rope_parameters(hf_config)
    legacy = getattr(hf_config, "rotary_dim", None)
    if legacy and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = legacy / hf_config.head_dim
    return params


class MiniMaxM2Attention(OlmoeAttention):
    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(hf_config, *args, **kwargs)
        self.rotary_dim = rotary_dim(self.head_dim, minimax_rope_parameters(hf_config))


class MiniMaxM2DecoderLayer(MoeDecoderLayer):
    attention_class = MiniMaxM2Attention

    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            scoring="sigmoid",
            grouping=GroupLimitedRouting(correction_bias=True),
        )


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    decoder_layer_class = MiniMaxM2DecoderLayer

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        return False, False, False  # OlmoeAttention adds its own q/k norms

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding:
        params = minimax_rope_parameters(hf_config)
        return RotaryEmbedding(rotary_dim(head_dim, params), params, dtype, device, True)

    def normalize_weight_name(self, name: str) -> str:
        # the block's bias sits beside the router, where DeepSeek's routing loads it from
        name = name.replace(".e_score_correction_bias", ".gate.e_score_correction_bias")
        return super().normalize_weight_name(name)
