"""OPT: learned positions (offset 2), LayerNorm, ReLU MLP, optional project_in/out, pre/post-LN."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.linear import Linear
from hybridllm.layers.norm import LayerNorm
from hybridllm.layers.prepared_attention import PreparedAttention, prepare_attention
from hybridllm.layers.tensor_parallel import (
    attention_heads,
    column_linear,
    lm_head,
    local_range,
    row_linear,
    vocab_embedding,
)
from hybridllm.layers.vocab_embedding import VocabEmbedding
from hybridllm.models.base import (
    CausalLMBase,
    WeightLoader,
    copy_loader,
    linear_loaders,
    vocab_loader,
)
from hybridllm.models.execution import LayerExecution

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup

_POSITION_OFFSET = 2  # OPT's position table starts 2 rows in (a fairseq padding legacy)
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


def _layer_norm_loaders(prefix: str, norm: LayerNorm) -> dict[str, WeightLoader]:
    if norm.weight is None:
        return {}
    return {
        f"{prefix}.weight": copy_loader(norm.weight, f"{prefix}.weight"),
        f"{prefix}.bias": copy_loader(norm.bias, f"{prefix}.bias"),
    }


class OPTDecoderLayer(nn.Module):
    """Under tensor parallelism: this rank's heads and fc1 columns; out_proj and fc2 sum."""

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        hidden = hf_config.hidden_size
        bias = bool(getattr(hf_config, "enable_bias", True))
        affine = bool(getattr(hf_config, "layer_norm_elementwise_affine", True))
        total_heads = hf_config.num_attention_heads
        self.head_dim = hidden // total_heads
        heads = attention_heads(total_heads, total_heads, tp_group)
        self.num_heads = heads.num_heads  # this rank's
        self.do_layer_norm_before = hf_config.do_layer_norm_before
        act = hf_config.activation_function
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"OPT activation {act!r} is not supported; supported: {list(_ACTIVATIONS)}"
            )
        self.activation = _ACTIVATIONS[act]
        self.self_attn_layer_norm = LayerNorm(hidden, dtype, device, elementwise_affine=affine)
        rows = heads.q_rows(self.head_dim)
        self.qkv_proj = column_linear(
            hidden, (hidden,) * 3, (rows,) * 3, bias, dtype, device, tp_group
        )
        self.out_proj = row_linear(hidden, rows, hidden, bias, dtype, device, tp_group)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, device)
        self.final_layer_norm = LayerNorm(hidden, dtype, device, elementwise_affine=affine)
        ffn = hf_config.ffn_dim
        cols = local_range(ffn, tp_group)
        self.fc1 = column_linear(hidden, (ffn,), (cols,), bias, dtype, device, tp_group)
        self.fc2 = row_linear(ffn, cols, hidden, bias, dtype, device, tp_group)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: None,
        kv_cache: torch.Tensor | None,
        prep: PreparedAttention,
    ) -> tuple[torch.Tensor, None]:
        """(hidden, residual) [n, hidden] -> (hidden, None): the layer adds its residuals
        inside, as in HF, so a residual passed in (a later stage's first layer) is added first.
        `rotary` is unused (OPT's positions are learned embeddings)."""
        if residual is not None:
            hidden_states = hidden_states + residual
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        hidden_states = residual + self.out_proj(self.attn(q, k, v, kv_cache, prep))
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)

        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states, None

    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        loaders = linear_loaders(
            f"{prefix}self_attn.", self.qkv_proj, ("q_proj", "k_proj", "v_proj")
        )
        loaders.update(linear_loaders(f"{prefix}self_attn.", self.out_proj, "out_proj"))
        loaders.update(linear_loaders(prefix, self.fc1, "fc1"))
        loaders.update(linear_loaders(prefix, self.fc2, "fc2"))
        loaders.update(
            _layer_norm_loaders(f"{prefix}self_attn_layer_norm", self.self_attn_layer_norm)
        )
        loaders.update(_layer_norm_loaders(f"{prefix}final_layer_norm", self.final_layer_norm))
        return loaders


class OPTForCausalLM(CausalLMBase):
    """OPT decoder stage.

    OPT layers carry the full hidden state, so a non-last stage returns
    (hidden_states, zeros): the next stage continues from their sum like the Llama family.
    """

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        start_layer: int = 0,
        end_layer: int | None = None,
        tp_group: TPGroup | None = None,
    ):
        hidden = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        local_heads = attention_heads(num_heads, num_heads, tp_group).num_heads
        super().__init__(
            hf_config,
            dtype,
            device,
            start_layer,
            end_layer,
            local_heads,
            hidden // num_heads,
            tp_group,
        )
        device = self.device
        vocab = hf_config.vocab_size
        proj_dim = getattr(hf_config, "word_embed_proj_dim", None) or hidden
        tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        affine = bool(getattr(hf_config, "layer_norm_elementwise_affine", True))

        self.embed_tokens = self.embed_positions = self.project_in = None
        if self.is_first_stage:
            self.embed_tokens = vocab_embedding(vocab, proj_dim, dtype, device, tp_group)
            self.embed_positions = VocabEmbedding(
                hf_config.max_position_embeddings + _POSITION_OFFSET, hidden, dtype, device
            )
            if proj_dim != hidden:
                self.project_in = Linear(proj_dim, hidden, False, dtype, device)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(hf_config, dtype, device, tp_group)
            for _ in range(self.num_layers_in_stage)
        )
        self.execution = LayerExecution(self.layers)
        self.final_layer_norm = self.project_out = None
        if self.is_last_stage:
            if hf_config.do_layer_norm_before and not getattr(
                hf_config, "_remove_final_layer_norm", False
            ):
                self.final_layer_norm = LayerNorm(hidden, dtype, device, elementwise_affine=affine)
            if proj_dim != hidden:
                self.project_out = Linear(hidden, proj_dim, False, dtype, device)
            self.lm_head = lm_head(
                vocab, proj_dim, dtype, device, tp_group, self.embed_tokens if tied else None
            )
        self._set_weight_loaders(*self._build_weight_loaders(tied))

    def normalize_weight_name(self, name: str) -> str:
        # original facebook/opt checkpoints name tensors "decoder.*" without "model."
        return "model." + name if name.startswith("decoder.") else name

    def _build_weight_loaders(self, tied: bool) -> tuple[dict[str, WeightLoader], set[str]]:
        prefix = "model.decoder."
        loaders: dict[str, WeightLoader] = {}
        optional: set[str] = set()
        for layer_idx, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            loaders.update(layer.weight_loaders(f"{prefix}layers.{layer_idx}."))
        embed = f"{prefix}embed_tokens.weight"
        if self.is_first_stage:
            loaders[embed] = vocab_loader(self.embed_tokens, embed)
            positions = f"{prefix}embed_positions.weight"
            loaders[positions] = copy_loader(self.embed_positions.weight, positions)
            if self.project_in is not None:
                loaders.update(linear_loaders(prefix, self.project_in, "project_in"))
        if self.is_last_stage:
            if self.final_layer_norm is not None:
                loaders.update(
                    _layer_norm_loaders(f"{prefix}final_layer_norm", self.final_layer_norm)
                )
            if self.project_out is not None:
                loaders.update(linear_loaders(prefix, self.project_out, "project_out"))
            loaders["lm_head.weight"] = vocab_loader(self.lm_head, "lm_head.weight")
            if tied:
                optional.add("lm_head.weight")
                if self.embed_tokens is None:
                    loaders[embed] = vocab_loader(self.lm_head, embed)
        return loaders, optional

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [n, word_embed_proj_dim] on the last stage, else (hidden, zeros)."""
        prep = prepare_attention(attn_metadata)
        if hidden_states is None:
            if self.embed_tokens is None:
                raise ValueError("a stage without the embedding needs hidden_states")
            hidden_states = self.embed_tokens(input_ids)  # [n, proj_dim]
            if self.project_in is not None:
                hidden_states = self.project_in(hidden_states)
            hidden_states = hidden_states + self.embed_positions(positions + _POSITION_OFFSET)
        # a later stage's residual joins the hidden state in its first layer
        hidden_states, _ = self.execution.run(
            hidden_states, residual, None, kv_caches, prep, positions, attn_metadata
        )
        if not self.is_last_stage:
            return hidden_states, torch.zeros_like(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states
