"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA attention rotating part of each head, q/k/v
bias and optional q/k norm, with DeepSeek-V3's routed and shared experts."""

from __future__ import annotations

from typing import Any

import torch

from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import (
    RotaryAngles,
    RotaryEmbedding,
    rope_parameters,
    rotary_dim,
)
from hybridllm.models.deepseek_v2 import deepseek_moe_spec
from hybridllm.models.llama import LlamaAttention
from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM


class Glm4MoeAttention(LlamaAttention):
    """Llama's attention rotating only the first `partial_rotary_factor` of each head."""

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(hf_config, *args, **kwargs)
        self.rotary_dim = rotary_dim(self.head_dim, rope_parameters(hf_config))

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [n, (H + 2 * kvh) * D]
        n = qkv.shape[0]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].view(n, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary.rotate_(q[..., : self.rotary_dim])
        rotary.rotate_(k[..., : self.rotary_dim])
        v = qkv[:, k_end:].view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, prep))


class Glm4MoeDecoderLayer(MoeDecoderLayer):
    attention_class = Glm4MoeAttention
    moe_spec = staticmethod(deepseek_moe_spec)


class Glm4MoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = Glm4MoeDecoderLayer
    supports_mtp = True  # method "mtp" drafts with the checkpoint's MTP layer (models/mtp.py)

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        # q/k/v biased where the config says; o_proj never
        return (
            bool(getattr(hf_config, "attention_bias", False)),
            False,
            bool(getattr(hf_config, "use_qk_norm", False)),
        )

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding:
        params = rope_parameters(hf_config)
        return RotaryEmbedding(rotary_dim(head_dim, params), params, dtype, device, True)
