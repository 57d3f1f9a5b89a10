"""Llama-family decoder (Llama 2/3, SmolLM2; base of Mistral, Qwen2 and Qwen3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.engine.kv_cache_groups import kv_cache_group_of_layer
from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.mlp import GatedMLP
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.prepared_attention import PreparedAttention, prepare_attention
from hybridllm.layers.rotary_embedding import RotaryAngles, RotaryEmbedding, rope_parameters
from hybridllm.layers.tensor_parallel import (
    attention_heads,
    column_linear,
    lm_head,
    row_linear,
    vocab_embedding,
)
from hybridllm.models.base import (
    CausalLMBase,
    WeightLoader,
    copy_loader,
    head_loader,
    linear_loaders,
    sliding_window_for_layer,
    vocab_loader,
)
from hybridllm.models.execution import LayerExecution
from hybridllm.models.native_decode import NativeLayer, native_layer

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup


class LlamaAttention(nn.Module):
    """Fused-qkv attention with RoPE; optional qkv/o biases and per-head q/k RMSNorm.

    Under tensor parallelism this rank computes its query heads and the KV heads they use;
    o_proj sums the ranks' partial outputs.
    """

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        heads = attention_heads(total_heads, total_kv_heads, tp_group)
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_rows, kv_rows = heads.q_rows(head_dim), heads.kv_rows(head_dim)
        full_q, full_kv = total_heads * head_dim, total_kv_heads * head_dim
        self.qkv_proj = column_linear(
            hidden,
            (full_q, full_kv, full_kv),
            (q_rows, kv_rows, kv_rows),
            qkv_bias,
            dtype,
            device,
            tp_group,
        )
        self.o_proj = row_linear(full_q, q_rows, hidden, o_bias, dtype, device, tp_group)
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(head_dim, eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, dtype, device) if qk_norm else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            device,
            sliding_window=sliding_window_for_layer(hf_config, layer_idx),
            kv_group=kv_cache_group_of_layer(hf_config, layer_idx),
            **self.paged_attention_options(hf_config, head_dim),
        )

    def paged_attention_options(self, hf_config: Any, head_dim: int) -> dict[str, Any]:
        """`PagedAttention`'s further keywords for this architecture (scale, logit_softcap,
        has_sinks); none for Llama."""
        return {}

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
        if self.q_norm is None:
            # q and k are adjacent in qkv: rotate both heads' sets in one go, in place
            rotary.rotate_(qkv[:, :k_end].view(n, -1, self.head_dim))
            q = qkv[:, :q_end].view(n, self.num_heads, self.head_dim)
            k = qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim)
        else:
            q = self.q_norm(qkv[:, :q_end].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim))
            rotary.rotate_(q)
            rotary.rotate_(k)
        v = qkv[:, k_end:].view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, prep))

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = linear_loaders(prefix, self.qkv_proj, ("q_proj", "k_proj", "v_proj"))
        loaders.update(linear_loaders(prefix, self.o_proj, "o_proj"))
        if self.q_norm is not None:
            loaders[f"{prefix}q_norm.weight"] = copy_loader(self.q_norm.weight, "q_norm.weight")
            loaders[f"{prefix}k_norm.weight"] = copy_loader(self.k_norm.weight, "k_norm.weight")
        return loaders


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP. Subclasses swap the attention class or the MLP (`build_mlp`,
    `mlp_weight_loaders`); an MoE layer builds an expert block in place of the dense MLP."""

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.self_attn = self.attention_class(
            hf_config, layer_idx, head_dim, qkv_bias, o_bias, qk_norm, dtype, device, tp_group
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.mlp = self.build_mlp(hf_config, layer_idx, dtype, device, tp_group)

    def build_mlp(
        self,
        hf_config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None,
    ) -> nn.Module:
        """The layer's feed-forward block: the dense gated MLP here."""
        return GatedMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            bool(getattr(hf_config, "mlp_bias", False)),
            getattr(hf_config, "hidden_act", "silu"),
            dtype,
            device,
            tp_group,
        )

    def mlp_weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """Loaders of the feed-forward block's weights, named under `prefix` ("...mlp.")."""
        loaders = linear_loaders(prefix, self.mlp.gate_up_proj, ("gate_proj", "up_proj"))
        loaders.update(linear_loaders(prefix, self.mlp.down_proj, "down_proj"))
        return loaders

    def native_form(self, activations: int) -> NativeLayer | None:
        """This layer as one native decode op, or None where a part has no native form. Only
        this attention class computes what the op does: subclasses (OLMoE's) change it."""
        if type(self.self_attn) is not LlamaAttention:
            return None
        return native_layer(self, activations)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); their sum is the layer's output hidden state."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rotary, kv_cache, prep)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = {
            f"{prefix}input_layernorm.weight": copy_loader(
                self.input_layernorm.weight, f"{prefix}input_layernorm.weight"
            ),
            f"{prefix}post_attention_layernorm.weight": copy_loader(
                self.post_attention_layernorm.weight, f"{prefix}post_attention_layernorm.weight"
            ),
        }
        loaders.update(self.self_attn.weight_loaders(f"{prefix}self_attn."))
        loaders.update(self.mlp_weight_loaders(f"{prefix}mlp."))
        return loaders


class LlamaForCausalLM(CausalLMBase):
    """Llama decoder stage. Subclasses change the attention options below or the layer class."""

    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        """(qkv_bias, o_bias, qk_norm) for this architecture."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, False

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        start_layer: int = 0,
        end_layer: int | None = None,
        tp_group: TPGroup | None = None,
    ):
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        local_kv_heads = attention_heads(num_heads, num_kv_heads, tp_group).num_kv_heads
        super().__init__(
            hf_config, dtype, device, start_layer, end_layer, local_kv_heads, head_dim, tp_group
        )
        device = self.device
        hidden, vocab = hf_config.hidden_size, hf_config.vocab_size
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        qkv_bias, o_bias, qk_norm = self._attention_options(hf_config)

        self.embed_tokens = (
            vocab_embedding(vocab, hidden, dtype, device, tp_group) if self.is_first_stage else None
        )
        self.rotary_emb = self._rotary_embedding(hf_config, head_dim, dtype, device)
        self._layer_args = (head_dim, qkv_bias, o_bias, qk_norm)
        self.layers = nn.ModuleList(
            self.make_layer(i, dtype, device, tp_group)
            for i in range(self.start_layer, self.end_layer)
        )
        self.execution = LayerExecution(self.layers)
        self.norm = None
        if self.is_last_stage:
            self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype, device)
            self.lm_head = lm_head(
                vocab, hidden, dtype, device, tp_group, self.embed_tokens if tied else None
            )
        self._set_weight_loaders(*self._build_weight_loaders(tied))

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding:
        """The model's RoPE table (every head dimension rotates here)."""
        return RotaryEmbedding(head_dim, rope_parameters(hf_config), dtype, device)

    def make_layer(
        self,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ) -> LlamaDecoderLayer:
        """A new decoder layer `layer_idx` of this model (weights uninitialised), e.g. the
        accelerator-side twin a weight streamer computes a CPU layer's steps with."""
        head_dim, qkv_bias, o_bias, qk_norm = self._layer_args
        return self.decoder_layer_class(
            self.hf_config, layer_idx, head_dim, qkv_bias, o_bias, qk_norm, dtype, device, tp_group
        )

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        loaders: dict[str, WeightLoader] = {}
        optional: set[str] = set()
        for layer_idx, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            loaders.update(layer.weight_loaders(f"model.layers.{layer_idx}."))
        embed = "model.embed_tokens.weight"
        if self.embed_tokens is not None:
            loaders[embed] = vocab_loader(self.embed_tokens, embed)
        if self.is_last_stage:
            loaders["model.norm.weight"] = copy_loader(self.norm.weight, "model.norm.weight")
            loaders["lm_head.weight"] = head_loader(self.lm_head, "lm_head.weight")
            if tied:
                # checkpoints of tied models usually omit lm_head.weight: take the embedding
                optional.add("lm_head.weight")
                loaders[embed] = head_loader(self.lm_head, embed, self.embed_tokens)
        return loaders, optional

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states [n, hidden] (Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final normed hidden states [n, hidden] on the last stage, else (hidden, residual).

        A later stage continues from the previous stage's (hidden_states, residual).
        """
        prep = prepare_attention(attn_metadata)
        rotary = self.rotary_emb(positions, attn_metadata.max_seq_len)
        if hidden_states is None:
            if self.embed_tokens is None:
                raise ValueError("a stage without the embedding needs hidden_states")
            hidden_states = self.embed_input_ids(input_ids)  # [n, hidden]
        hidden_states, residual = self.execution.run(
            hidden_states, residual, rotary, kv_caches, prep, positions, attn_metadata
        )
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
