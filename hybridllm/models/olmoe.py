"""OLMoE: routed experts in every layer; q and k normed across all their heads, optionally clipped."""

from __future__ import annotations

from typing import Any

import torch

from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import RotaryAngles
from hybridllm.models.llama import LlamaAttention
from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeSpec, expert_count


class OlmoeAttention(LlamaAttention):
    """`q_norm` over the whole q [n, heads * D] and `k_norm` over k [n, kv_heads * D] (not per
    head as in Qwen3), then q, k and v clamped to +-clip_qkv when the config sets it."""

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(hf_config, *args, **kwargs)
        eps, dtype, device = (
            hf_config.rms_norm_eps,
            self.qkv_proj.weight.dtype,
            self.qkv_proj.weight.device,
        )
        self.q_norm = RMSNorm(self.q_size, eps, dtype, device)
        self.k_norm = RMSNorm(self.kv_size, eps, dtype, device)
        self.clip_qkv = getattr(hf_config, "clip_qkv", None)
        self.rotary_dim = self.head_dim  # MiniMax-M2 rotates a part of each head

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
        q = self.q_norm(qkv[:, :q_end].contiguous())  # [n, H * D]
        k = self.k_norm(qkv[:, q_end:k_end].contiguous())  # [n, kvh * D]
        v = qkv[:, k_end:]
        if self.clip_qkv is not None:
            q, k = q.clamp_(-self.clip_qkv, self.clip_qkv), k.clamp_(-self.clip_qkv, self.clip_qkv)
            v = v.clamp(-self.clip_qkv, self.clip_qkv)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        rotary.rotate_(q[..., : self.rotary_dim])
        rotary.rotate_(k[..., : self.rotary_dim])
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, prep))


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class = OlmoeAttention

    @staticmethod
    def moe_spec(hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=expert_count(hf_config, 64),
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=bool(hf_config.norm_topk_prob),
        )


class OlmoeForCausalLM(MoeForCausalLM):
    decoder_layer_class = OlmoeDecoderLayer
