"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's four norms a layer, (1 + w) norm
weights, GELU-tanh MLP, a scaled embedding, `query_pre_attn_scalar`, sliding-window layers
interleaved with global ones, and soft-capped attention and final logits (Gemma 2).

Gemma 3 adds an RMSNorm over each q and k head and gives sliding and global layers their own
RoPE (a local base, and the global one's scaling). `Gemma3ForConditionalGeneration` folders
load their text part: the config's `text_config` and the `language_model` weights.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.layers.mlp import GatedMLP
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.prepared_attention import PreparedAttention
from hybridllm.layers.rotary_embedding import RotaryAngles, RotaryEmbedding, rope_parameters
from hybridllm.models.base import WeightLoader, copy_loader, sliding_window_for_layer
from hybridllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

SLIDING, FULL = "sliding_attention", "full_attention"
# a checkpoint's norm weights w, applied as (1 + w)
_NORM_WEIGHT = re.compile(r"(?:layernorm|norm)\.weight$")


def layer_type(hf_config: Any, layer_idx: int) -> str:
    """ "sliding_attention" or "full_attention" for the layer."""
    return SLIDING if sliding_window_for_layer(hf_config, layer_idx) is not None else FULL


def gemma_rope_parameters(hf_config: Any, kind: str) -> dict[str, Any]:
    """The RoPE settings of one layer kind: Gemma 3 keeps one dict per kind in
    `rope_parameters` (transformers 5) or `rope_theta` + `rope_local_base_freq` (4.x)."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    if kind in nested:
        params = dict(nested[kind])
        params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
        return params
    params = rope_parameters(hf_config)
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    if kind == SLIDING and local_base is not None:
        params = {"rope_type": "default", "rope_theta": float(local_base)}
    return params


def plus_one(loader: WeightLoader) -> WeightLoader:
    """`loader` given 1 + w: Gemma's norms scale by (1 + weight), computed once here."""

    def load(loaded: torch.Tensor) -> None:
        loader(loaded.float() + 1.0)

    return load


class PerKindRotary(nn.Module):
    """One RoPE table per layer kind; a step's angles are a dict kind -> `RotaryAngles`."""

    def __init__(self, tables: dict[str, RotaryEmbedding]):
        super().__init__()
        self.tables = nn.ModuleDict(tables)

    def recast_(self, dtype: torch.dtype) -> None:
        for table in self.tables.values():
            table.recast_(dtype)

    def forward(self, positions: torch.Tensor, max_seq_len: int) -> dict[str, RotaryAngles]:
        return {kind: table(positions, max_seq_len) for kind, table in self.tables.items()}


class GemmaAttention(LlamaAttention):
    """Llama's attention scaled by `query_pre_attn_scalar`, soft-capped where the config says;
    its rotation is its layer kind's where the model has one per kind."""

    def __init__(self, hf_config: Any, layer_idx: int, *args: Any, **kwargs: Any):
        super().__init__(hf_config, layer_idx, *args, **kwargs)
        self.kind = layer_type(hf_config, layer_idx)

    def paged_attention_options(self, hf_config: Any, head_dim: int) -> dict[str, Any]:
        scalar = getattr(hf_config, "query_pre_attn_scalar", None) or head_dim
        return {
            "scale": float(scalar) ** -0.5,
            "logit_softcap": getattr(hf_config, "attn_logit_softcapping", None),
        }

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryAngles | dict[str, RotaryAngles],
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> torch.Tensor:
        if isinstance(rotary, dict):
            rotary = rotary[self.kind]
        return super().forward(hidden_states, rotary, kv_cache, prep)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Norms before and after both the attention and the MLP; GELU-tanh MLP."""

    attention_class = GemmaAttention

    def __init__(self, hf_config: Any, layer_idx: int, *args: Any, **kwargs: Any):
        super().__init__(hf_config, layer_idx, *args, **kwargs)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        dtype, device = self.input_layernorm.weight.dtype, self.input_layernorm.weight.device
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device)

    def build_mlp(
        self,
        hf_config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None,
    ) -> nn.Module:
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        return GatedMLP(
            hf_config.hidden_size, hf_config.intermediate_size, False, act, dtype, device, tp_group
        )

    def native_form(self, activations: int) -> None:
        return None  # four norms a layer: not the native op's layer

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryAngles | dict[str, RotaryAngles],
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rotary, kv_cache, prep)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = super().weight_loaders(prefix)
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            full = f"{prefix}{name}.weight"
            loaders[full] = copy_loader(getattr(self, name).weight, full)
        return loaders


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: one RoPE for every layer, no q/k norm, soft-capped attention and logits."""

    decoder_layer_class = GemmaDecoderLayer
    qk_norm = False

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(hf_config, *args, **kwargs)
        # HF multiplies by sqrt(hidden) rounded to the model's dtype: a 0-dim tensor does
        self.embed_scale = torch.tensor(hf_config.hidden_size**0.5, dtype=self.dtype)
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)

    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, self.qk_norm

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        loaders, optional = super()._build_weight_loaders(tied)
        for name in [n for n in loaders if _NORM_WEIGHT.search(n)]:
            loaders[name] = plus_one(loaders[name])
        return loaders, optional

    def normalize_weight_name(self, name: str) -> str:
        # Gemma3ForConditionalGeneration: transformers 5's `model.language_model.*`, 4.x's
        # `language_model.model.*` (and its `language_model.lm_head`)
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        if name.startswith("language_model."):
            return name[len("language_model.") :]
        return name

    def _check_skippable(self, name: str) -> None:
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            return  # the image side of a multimodal folder
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return
        super()._check_skippable(name)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap).mul_(self.final_softcap)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norm, and a local RoPE for sliding layers beside the global one."""

    qk_norm = True

    def _rotary_embedding(
        self, hf_config: Any, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> PerKindRotary:
        return PerKindRotary(
            {
                kind: RotaryEmbedding(
                    head_dim, gemma_rope_parameters(hf_config, kind), dtype, device
                )
                for kind in (SLIDING, FULL)
            }
        )
