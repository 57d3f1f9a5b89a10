"""Llama-family decoder (Llama 2/3, SmolLM2; base of Mistral, Qwen2 and Qwen3)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.gguf_linear import default_activations
from hybridllm.layers.linear import Linear
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

if TYPE_CHECKING:
    from hybridllm.distributed.parallel_groups import TPGroup


# "0" turns the native whole-layer decode off (the per-op path then runs every step).
NATIVE_DECODE_ENV = "HYBRIDLLM_NATIVE_DECODE_LAYER"


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
        )

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
        # the `activations` of the native whole-layer decode (use_native_decode); None: off
        self.native_decode_activations: int | None = None
        self.native_decode_mlp = False  # whether the native call computes the MLP too
        # the native call's arguments that do not change from step to step: (those before the
        # rotary angles, those after the attention inputs); set with native_decode_activations
        self.native_decode_args: tuple[tuple, tuple] = ((), ())
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

    def use_native_decode(self, activations: int) -> None:
        """Let CPU decode steps run this layer as one `hybridllm::decode_layer` call, when every
        piece has its native form here: plain fp32/GGUF-block linears, compiled norms and
        attention. A dense SiLU MLP joins the call; another block (MoE) runs after it in Python.
        Otherwise the per-op path stays."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not LlamaAttention:  # subclasses (OLMoE's) change the projections
            return
        fused = [attn.qkv_proj]  # blocks in one tensor, or one a shard of differing types
        plain = [attn.o_proj]  # blocks in one tensor
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        self.native_decode_mlp = type(mlp) is GatedMLP and mlp.native
        if self.native_decode_mlp:
            fused.append(mlp.gate_up_proj)
            plain.append(mlp.down_proj)
        if (
            all(type(linear) is Linear for linear in fused + plain)
            and all(linear.block_shards() is not None for linear in fused)
            and all(linear.qweight is not None for linear in plain)
            and all(linear.bias is None for linear in fused[1:] + plain)  # only qkv may (Qwen2)
            and all(norm.native and norm.eps == norms[0].eps for norm in norms)
            and getattr(attn.attn.backend, "native_ops", False)
        ):
            self.native_decode_activations = activations
            # looked up once: read through nn.Module attributes every step they cost ~10 us a
            # layer at batch 1 (SmolLM2), as much as its attention
            down = mlp.down_proj if self.native_decode_mlp else None
            qkv_weights, qkv_types = attn.qkv_proj.block_shards()
            gate_up_weights, gate_up_types = (
                mlp.gate_up_proj.block_shards() if self.native_decode_mlp else ([], [])
            )
            self.native_decode_args = (
                (
                    self.input_layernorm.weight,
                    self.post_attention_layernorm.weight,
                    self.input_layernorm.eps,
                    qkv_weights,
                    qkv_types,
                    attn.qkv_proj.bias,
                    None if attn.q_norm is None else attn.q_norm.weight,
                    None if attn.k_norm is None else attn.k_norm.weight,
                    attn.o_proj.qweight,
                    attn.o_proj.ggml_type,
                    gate_up_weights,
                    gate_up_types,
                    None if down is None else down.qweight,
                    -1 if down is None else down.ggml_type,
                ),
                (
                    attn.attn.scale,
                    attn.attn.sliding_window or 0,
                    attn.num_heads,
                    attn.num_kv_heads,
                    activations,
                ),
            )

    def native_moe_args(self) -> tuple | None:
        """`DecodeStack.add_moe`'s arguments where the decode stack can run this layer's expert
        block itself (MoE layers override); None: a dense layer, or an expert block it cannot."""
        return None

    def decode_native(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryAngles,
        kv_cache: torch.Tensor,
        prep: PreparedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a step of decode rows only, fp32: the native op, then the MLP block
        when the op did not take it."""
        weights, attention = self.native_decode_args
        out, residual = torch.ops.hybridllm.decode_layer.default(
            hidden_states,
            residual,
            *weights,
            rotary.cos,
            rotary.sin_signed,
            kv_cache,
            prep.slot_mapping,
            prep.decode_block_tables,
            prep.decode_seq_lens,
            *attention,
        )
        return (out, residual) if self.native_decode_mlp else (self.mlp(out), residual)

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
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(hf_config), dtype, device)
        self._layer_args = (head_dim, qkv_bias, o_bias, qk_norm)
        self.layers = nn.ModuleList(
            self.make_layer(i, dtype, device, tp_group)
            for i in range(self.start_layer, self.end_layer)
        )
        # torch.classes.hybridllm.DecodeStack of every layer, when all decode natively
        # (process_weights_after_loading)
        self.decode_stack = None
        self.norm = None
        if self.is_last_stage:
            self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype, device)
            self.lm_head = lm_head(
                vocab, hidden, dtype, device, tp_group, self.embed_tokens if tied else None
            )
        self._set_weight_loaders(*self._build_weight_loaders(tied))

    def process_weights_after_loading(self) -> None:
        """The base's treatment, then CPU decode steps through the native whole-layer op where
        every piece of a layer has its native form (`HYBRIDLLM_NATIVE_DECODE_LAYER=0`: off)."""
        processed = self._weights_processed
        super().process_weights_after_loading()
        if processed or self.device.type != "cpu" or not load_cpu_kernels():
            return
        if os.environ.get(NATIVE_DECODE_ENV, "1") == "0":
            return
        activations = default_activations()
        for layer in self.layers:
            layer.use_native_decode(activations)
        moe = [layer.native_moe_args() for layer in self.layers]
        if len(self.layers) > 0 and all(
            layer.native_decode_activations is not None
            and (layer.native_decode_mlp or moe_args is not None)
            for layer, moe_args in zip(self.layers, moe)
        ):
            # every layer native with its MLP or expert block: one call from Python runs them all
            self.decode_stack = torch.classes.hybridllm.DecodeStack()
            for layer, moe_args in zip(self.layers, moe):
                weights, attention = layer.native_decode_args
                self.decode_stack.add_layer(*weights, *attention)
                if moe_args is not None:
                    self.decode_stack.add_moe(*moe_args)

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
            hidden_states = self.embed_tokens(input_ids)  # [n, hidden]
        # a CPU step of decode rows only: eligible layers in one native call each
        native = (
            rotary.native
            and bool(kv_caches)
            and prep.num_decodes == hidden_states.shape[0] > 0
            and hidden_states.dtype == torch.float32
        )
        streamer = self.weight_streamer
        if streamer is not None and streamer.wants(attn_metadata, kv_caches):
            # Many tokens: the layers' weights go to the accelerator and compute there.
            hidden_states, residual = streamer.run(
                self.layers, kv_caches, hidden_states, residual, positions, attn_metadata
            )
        elif native and self.decode_stack is not None:
            # every layer native with its MLP: all of them in one call
            hidden_states, residual = self.decode_stack.forward(
                hidden_states,
                residual,
                rotary.cos,
                rotary.sin_signed,
                kv_caches,
                prep.slot_mapping,
                prep.decode_block_tables,
                prep.decode_seq_lens,
            )
        else:
            for i, layer in enumerate(self.layers):
                kv_cache = kv_caches[i] if kv_caches else None
                if native and layer.native_decode_activations is not None:
                    hidden_states, residual = layer.decode_native(
                        hidden_states, residual, rotary, kv_cache, prep
                    )
                else:
                    hidden_states, residual = layer(hidden_states, residual, rotary, kv_cache, prep)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
