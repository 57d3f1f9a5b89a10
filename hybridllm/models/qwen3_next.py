"""Qwen3-Next and Qwen3.5-MoE (text): Gated DeltaNet layers with a gated full-attention layer
every `full_attention_interval`, (1 + w) norms, and many small experts beside a sigmoid-gated
shared expert.

The full-attention layers project each head's query and an output gate together (q_proj is
[heads * 2 * head_dim, hidden], per head [query | gate]), norm q and k per head, rotate the first
`partial_rotary_factor` of each head and scale the attention output by sigmoid(gate). The linear
layers (layers/gated_delta_net.py) keep one state per sequence in the KV cache's state group
(engine/kv_cache_groups.py). Qwen3.5's multimodal RoPE sections all carry the same position for
text, so its text positions rotate as plain RoPE does. `Qwen3_5MoeForConditionalGeneration`
folders load their text part.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.engine.kv_cache_groups import is_linear_attention_layer, kv_cache_group_of_layer
from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.gated_delta_net import (
    DeltaNetBatch,
    DeltaNetShape,
    DeltaNetState,
    GatedDeltaNet,
)
from hybridllm.layers.linear import Linear
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import (
    RotaryAngles,
    RotaryEmbedding,
    rope_parameters,
    rotary_dim,
)
from hybridllm.models.base import WeightLoader, copy_loader, linear_loaders
from hybridllm.models.gemma import plus_one
from hybridllm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeSpec, expert_count
from hybridllm.plan.moe_size import qwen_dense_layers

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup
    from hybridllm.models.native_decode import NativeLayer

# norms applied as (1 + w); the Gated DeltaNet's own `linear_attn.norm` is applied as w
_PLUS_ONE_NORM = re.compile(r"(?:layernorm|q_norm|k_norm|model\.norm)\.weight$")
_TEXT_PREFIX = "model.language_model."


def qwen3_next_moe_spec(hf_config: Any) -> MoeSpec:
    return MoeSpec(
        num_experts=expert_count(hf_config, 512),
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        # Qwen3.5's router always renormalises (its config has no norm_topk_prob)
        renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
        shared_intermediate_size=int(hf_config.shared_expert_intermediate_size or 0),
        dense_layers=qwen_dense_layers(hf_config),
    )


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, (1 + w) q/k norms and partial rotary."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # rows: q_proj as the checkpoint keeps it (per head: query, gate) | k | v
        self.qkv_proj = Linear(
            hidden, (2 * self.q_size, self.kv_size, self.kv_size), bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, hidden, bias, dtype, device)
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(head_dim, eps, dtype, device)
        self.k_norm = RMSNorm(head_dim, eps, dtype, device)
        self.rotary_dim = rotary_dim(head_dim, rope_parameters(hf_config))
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            device,
            kv_group=kv_cache_group_of_layer(hf_config, layer_idx),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [n, 2 * H * D + 2 * kvh * D]
        n, D = qkv.shape[0], self.head_dim
        q_end, k_end = 2 * self.q_size, 2 * self.q_size + self.kv_size
        query_gate = qkv[:, :q_end].view(n, self.num_heads, 2 * D)
        q = self.q_norm(query_gate[..., :D].contiguous())  # [n, H, D]
        gate = query_gate[..., D:].reshape(n, self.q_size)  # [n, H * D]
        k = self.k_norm(qkv[:, q_end:k_end].reshape(n, self.num_kv_heads, D))
        rotary.rotate_(q[..., : self.rotary_dim])
        rotary.rotate_(k[..., : self.rotary_dim])
        v = qkv[:, k_end:].view(n, self.num_kv_heads, D)
        out = self.attn(q, k, v, kv_cache, prep).reshape(n, self.q_size)  # [n, H * D]
        return self.o_proj(out * torch.sigmoid(gate))

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = linear_loaders(prefix, self.qkv_proj, ("q_proj", "k_proj", "v_proj"))
        loaders.update(linear_loaders(prefix, self.o_proj, "o_proj"))
        for name in ("q_norm", "k_norm"):
            full = f"{prefix}{name}.weight"
            loaders[full] = copy_loader(getattr(self, name).weight, full)
        return loaders


class Qwen3NextDecoderLayer(MoeDecoderLayer):
    """Pre-norm token mixer (Gated DeltaNet or gated attention) and MLP (experts or dense)."""

    moe_spec = staticmethod(qwen3_next_moe_spec)

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        experts_device: torch.device | None = None,
    ):
        nn.Module.__init__(self)  # not Llama's: the token mixer differs by layer kind
        self._experts_device = experts_device  # read by build_mlp
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if is_linear_attention_layer(hf_config, layer_idx):
            self.linear_attn = GatedDeltaNet(hf_config, dtype, device)
            self.linear_attn.kv_group = kv_cache_group_of_layer(hf_config, layer_idx)
        else:
            bias = bool(getattr(hf_config, "attention_bias", False))
            self.self_attn = GatedAttention(hf_config, layer_idx, head_dim, bias, dtype, device)
        self.mlp = self.build_mlp(hf_config, layer_idx, dtype, device, None)

    def native_form(self, activations: int) -> NativeLayer | None:
        return None  # neither token mixer has a native whole-layer op

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.linear_attn is not None:
            deltanet = self.linear_attn
            state = DeltaNetState.in_buffer(deltanet.shape, kv_cache)
            hidden_states = deltanet(hidden_states, DeltaNetBatch.of_step(prep), state)
        else:
            hidden_states = self.self_attn(hidden_states, rotary, kv_cache, prep)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = {
            f"{prefix}{name}.weight": copy_loader(
                getattr(self, name).weight, f"{prefix}{name}.weight"
            )
            for name in ("input_layernorm", "post_attention_layernorm")
        }
        if self.linear_attn is not None:
            loaders.update(self.linear_attn.weight_loaders(f"{prefix}linear_attn."))
        else:
            loaders.update(self.self_attn.weight_loaders(f"{prefix}self_attn."))
        loaders.update(self.mlp_weight_loaders(f"{prefix}mlp."))
        return loaders


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Qwen3-Next / Qwen3.5-MoE stage: the MoE decoder's embedding, experts, placement and
    loading, with this file's layers and a linear-attention state cache."""

    decoder_layer_class = Qwen3NextDecoderLayer

    def _check_config(self, hf_config: Any) -> None:
        if getattr(hf_config, "layer_types", None) is None:
            raise ValueError("Qwen3-Next needs layer_types (or full_attention_interval)")

    def make_layer(
        self,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ) -> Qwen3NextDecoderLayer:
        head_dim = self._layer_args[0]
        experts = torch.device("cpu") if layer_idx < self._cpu_experts_end else None
        return Qwen3NextDecoderLayer(self.hf_config, layer_idx, head_dim, dtype, device, experts)

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding:
        params = rope_parameters(hf_config)
        return RotaryEmbedding(rotary_dim(head_dim, params), params, dtype, device, True)

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        loaders, optional = super()._build_weight_loaders(tied)
        for name in [n for n in loaders if _PLUS_ONE_NORM.search(n)]:
            loaders[name] = plus_one(loaders[name])
        # Qwen3-Next folders fuse in_proj_qkvz, its GGUF files split it: either is complete
        for layer_idx, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            if layer.linear_attn is not None:
                prefix = f"model.layers.{layer_idx}.linear_attn."
                self._covers.update(layer.linear_attn.fused_names(prefix))
        optional |= set(self._covers)
        return loaders, optional

    def normalize_weight_name(self, name: str) -> str:
        if name.startswith(_TEXT_PREFIX):  # Qwen3_5MoeForConditionalGeneration's text model
            name = "model." + name[len(_TEXT_PREFIX) :]
        return super().normalize_weight_name(name)

    def _check_skippable(self, name: str) -> None:
        if name.startswith(("model.visual.", "mtp.")):
            return  # the image encoder, and the multi-token-prediction head (not used)
        super()._check_skippable(name)

    def state_floats_per_slot(self) -> int:
        """fp32 values of one sequence's state in one linear-attention layer."""
        return DeltaNetState.floats_per_slot(DeltaNetShape.from_hf(self.hf_config))
