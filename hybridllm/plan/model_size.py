"""Bytes and FLOPs of a model's parts (decoder layer, embedding, head, KV) from its HF config alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridllm.engine.kv_cache_groups import is_linear_attention_layer, sliding_window_for_layer
from hybridllm.plan.moe_size import MoeSize

if TYPE_CHECKING:
    from hybridllm.plan.plan import StagePlan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss", "minimax_m2")
# multi-head latent attention: the cache holds one latent row a token a layer
_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")


@dataclass(frozen=True)
class ModelSize:
    """Per-part parameter bytes at one dtype, plus what a step reads and computes.

    `*_bytes` are parameter bytes; `matmul_params_per_layer` counts only the weights a token
    multiplies by (what decode FLOPs come from), not norms or biases.
    """

    model_type: str
    dtype: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    layer_bytes: int  # one decoder layer
    embedding_bytes: int  # token (+ position) embedding, + OPT's project_in
    final_norm_bytes: int  # final norm (+ OPT's project_out)
    lm_head_bytes: int  # an own copy of the LM head matrix
    matmul_params_per_layer: int
    kv_bytes_per_token_per_layer: int  # K and V of one token in one layer, all KV heads
    mlp_matrices: int  # 3 for a gated MLP (gate, up, down), 2 for OPT's fc1, fc2
    layer_other_bytes: int  # norms and biases of one layer (counted whole on every shard)
    # A GGUF file's blocks as a CPU worker keeps them (a tensor-parallel one its share; see
    # `GGUFBlockSizes`); None: every worker holds dtype-sized weights.
    cpu_blocks: GGUFBlockSizes | None = None
    matmul_bytes_per_param: float | None = None  # set on the CPU view only; else dtype bytes
    # kv_bytes_per_token_per_layer on CPU workers where their cache dtype differs (a 16-bit
    # cache under fp32 compute: plan/cpu_dtype.py); None: the same
    cpu_kv_bytes_per_token_per_layer: int | None = None
    # Mixtures of experts: layers differ (sparse or dense), `layer_bytes` and
    # `matmul_params_per_layer` are the largest layer's; use the `layer_*` methods below.
    moe: MoeSize | None = None
    # MLA's attention matmul parameters (q, kv_a, kv_b, o); 0: per-head q/k/v/o from head_dim
    mla_attention_params: int = 0
    # each layer's sliding window (None: full attention); empty when no layer has one. A
    # sliding layer's KV cache is bounded per sequence (engine/kv_cache_groups.py)
    layer_windows: tuple[int | None, ...] = ()
    # each layer's kind, True for linear attention (empty when none is): such a layer holds
    # `state_bytes_per_layer` per running sequence (fp32) instead of KV per token, and its
    # projections are `linear_attention_params`
    linear_layers: tuple[bool, ...] = ()
    gated_query: bool = False  # q_proj also gives each head's output gate (Qwen3-Next)
    linear_attention_params: int = 0
    linear_other_bytes: int = 0  # a linear layer's norms, conv taps and decay parameters
    state_bytes_per_layer: int = 0
    # speculative decoding's "mtp" method: MTP layers the last stage holds beside its own
    mtp_layers: int = 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def for_worker(self, stage: StagePlan, tp_rank: int) -> ModelSize:
        """The sizes worker `tp_rank` of `stage` holds: GGUF blocks on a CPU worker."""
        if not stage.workers[tp_rank].is_cpu:
            return self
        return self.cpu_view()

    def cpu_view(self) -> ModelSize:
        """The sizes a CPU worker holds (GGUF blocks where it keeps them, its KV cache's dtype;
        else unchanged)."""
        blocks, kv = self.cpu_blocks, self.cpu_kv_bytes_per_token_per_layer
        if kv is not None:
            return dataclasses.replace(
                self, kv_bytes_per_token_per_layer=kv, cpu_kv_bytes_per_token_per_layer=None
            ).cpu_view()
        if blocks is None:
            return self
        bytes_per_param = blocks.matmul_bytes_per_param(self.dtype_bytes)
        head = self.lm_head_bytes if blocks.lm_head_bytes is None else blocks.lm_head_bytes
        embedding = (
            self.embedding_bytes if blocks.embedding_bytes is None else blocks.embedding_bytes
        )
        return dataclasses.replace(
            self,
            layer_bytes=round(self.matmul_params_per_layer * bytes_per_param)
            + self.layer_other_bytes,
            lm_head_bytes=head,
            embedding_bytes=embedding,  # tied_embeddings stays: head and embedding share one table
            cpu_blocks=None,
            matmul_bytes_per_param=bytes_per_param,
        )

    @property
    def total_bytes(self) -> int:
        """The whole model on one device (a tied head shares the embedding's bytes)."""
        return self.stage_bytes(0, self.num_layers, True, True)

    def stage_bytes(
        self, layer_start: int, layer_end: int, has_embedding: bool, has_lm_head: bool
    ) -> int:
        """Parameter bytes of one pipeline stage (before tensor-parallel sharding)."""
        total = sum(self.layer_weight_bytes(i) for i in range(layer_start, layer_end))
        if has_embedding:
            total += self.embedding_bytes
        if has_lm_head:
            total += self.final_norm_bytes + self.head_matrix_bytes(has_embedding)
        return total

    def head_matrix_bytes(self, has_embedding: bool) -> int:
        """LM head bytes a stage must store: none extra when it is tied to an embedding it holds."""
        return 0 if (self.tied_embeddings and has_embedding) else self.lm_head_bytes

    def shard_matmul_params(self, q_heads: int, kv_heads: int, intermediate: int) -> int:
        """Matmul weights of one layer's tensor-parallel shard: q/k/v/o of its heads + its MLP slice
        (MLA's attention is not sharded: such models run without tensor parallelism)."""
        q, kv = q_heads * self.head_dim, kv_heads * self.head_dim
        attention = (
            self.mla_attention_params
            or self.hidden_size * ((2 if self.gated_query else 1) * q + 2 * kv)
            + q * self.hidden_size
        )
        return attention + self.mlp_matrices * self.hidden_size * intermediate

    def shard_layer_bytes(self, q_heads: int, kv_heads: int, intermediate: int) -> int:
        matmul = self.shard_matmul_params(q_heads, kv_heads, intermediate)
        per_param = self.matmul_bytes_per_param or self.dtype_bytes
        return round(matmul * per_param) + self.layer_other_bytes

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    def attention_params(self, layer: int) -> int:
        """Matmul weights of `layer`'s token mixer (unsharded)."""
        if self.is_linear(layer):
            return self.linear_attention_params
        return self.shard_matmul_params(self.num_heads, self.num_kv_heads, 0)

    def layer_matmul_params(self, layer: int, routed: bool = True) -> int:
        """Matmul weights of decoder layer `layer`, its routed experts left out unless `routed`."""
        if self.moe is None:
            return self.matmul_params_per_layer
        return self.attention_params(layer) + self.moe.mlp_params(layer, routed)

    def layer_weight_bytes(self, layer: int, routed: bool = True) -> int:
        """Parameter bytes of decoder layer `layer` (unsharded), without its routed experts
        unless `routed`."""
        if self.moe is None:
            return self.layer_bytes
        per_param = self.matmul_bytes_per_param or self.dtype_bytes
        other = self.linear_other_bytes if self.is_linear(layer) else self.layer_other_bytes
        return round(self.layer_matmul_params(layer, routed) * per_param) + other

    def mtp_bytes(self, routed: bool = True) -> int:
        """What the MTP layers beside the last stage hold (0 without them): each a decoder
        layer sized as the model's layer of its index (its routed experts unless `routed` is
        False), its three norms, the [hidden, 2 x hidden] projection, and an embedding and an
        LM head of its own (as DeepSeek's checkpoints carry them)."""
        per_param = self.matmul_bytes_per_param or self.dtype_bytes
        own = 3 * self.hidden_size * self.dtype_bytes + round(2 * self.hidden_size**2 * per_param)
        return sum(
            self.layer_weight_bytes(self.num_layers + i, routed)
            + own
            + self.embedding_bytes
            + self.lm_head_bytes
            for i in range(self.mtp_layers)
        )

    def routed_expert_bytes(self, layer: int) -> int:
        """Bytes of every routed expert of `layer` (0 for dense layers and dense models)."""
        if self.moe is None or not self.moe.is_sparse(layer):
            return 0
        return round(self.moe.routed_params * (self.matmul_bytes_per_param or self.dtype_bytes))

    def step_weight_bytes(self, layer: int, num_tokens: int, routed: bool = True) -> float:
        """Weight bytes one step of `num_tokens` tokens reads in `layer`: every non-expert
        weight, and only the experts its tokens select (expected distinct experts)."""
        if self.moe is None:
            return self.layer_bytes
        fixed = self.layer_weight_bytes(layer, routed=False)
        if not routed or not self.moe.is_sparse(layer):
            return fixed
        share = self.moe.active_experts(num_tokens) / self.moe.num_experts
        return fixed + share * self.routed_expert_bytes(layer)

    def active_matmul_params(self, layer: int, routed: bool = True) -> int:
        """Weights one token multiplies by in `layer` (top_k experts of a sparse layer)."""
        if self.moe is None:
            return self.matmul_params_per_layer
        attention = self.attention_params(layer)
        if not routed:
            return attention + self.moe.mlp_params(layer, routed=False)
        return attention + self.moe.active_mlp_params(layer)

    def kv_bytes_per_token(self, num_layers: int) -> int:
        return num_layers * self.kv_bytes_per_token_per_layer

    def full_attention_layers(self, start: int, end: int) -> int:
        """How many of layers [start, end) keep every token's KV (no sliding window, not linear
        attention)."""
        layers = [i for i in range(start, end) if not self.is_linear(i)]
        if not self.layer_windows:
            return len(layers)
        return sum(self.layer_windows[i] is None for i in layers)

    def attended_context(self, start: int, end: int, context_len: int) -> int:
        """Keys a query at `context_len` reads, summed over layers [start, end) (linear
        attention reads its state: none)."""
        layers = [i for i in range(start, end) if not self.is_linear(i)]
        if not self.layer_windows:
            return len(layers) * context_len
        return sum(min(context_len, self.layer_windows[i] or context_len) for i in layers)

    def state_bytes(self, start: int, end: int, max_num_seqs: int) -> int:
        """Linear-attention state layers [start, end) hold for `max_num_seqs` sequences."""
        layers = sum(self.is_linear(i) for i in range(start, end))
        return layers * max_num_seqs * self.state_bytes_per_layer

    def sliding_kv_tokens(
        self, start: int, end: int, max_tokens: int, max_num_seqs: int, chunk: int
    ) -> int:
        """KV rows layers [start, end)'s sliding windows hold together, at most: each holds
        `max_num_seqs` sequences' windows plus one step's `chunk` tokens (and a block of 16
        straddling per sequence), never more than the `max_tokens` a full layer would."""
        windows = [w for w in self.layer_windows[start:end] if w is not None]
        return sum(min(max_tokens, max_num_seqs * (w + 16) + chunk) for w in windows)

    def activation_bytes(self, num_tokens: int) -> int:
        """Transient workspace of one forward over `num_tokens` (the largest live tensors of a layer).

        hidden + residual + fused qkv + attention output + gate/up + MLP product, at the dtype,
        plus fp32 logits for up to 256 sampled rows; a bound, not an allocator trace.
        """
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_token = 3 * self.hidden_size + q + 2 * kv + q + 3 * self.intermediate_size
        logits = min(num_tokens, 256) * self.vocab_size * 4
        return num_tokens * per_token * self.dtype_bytes + logits


@dataclass(frozen=True)
class GGUFBlockSizes:
    """What a CPU worker holds of a GGUF file whose linears it computes from their blocks."""

    kept_params: int  # decoder-layer matmul parameters kept as blocks (all layers)
    kept_bytes: int  # their bytes as blocks
    total_params: int  # all decoder-layer matmul parameters (the rest are dequantized)
    lm_head_bytes: int | None  # the head's blocks; None when the head is dequantized
    embedding_bytes: int | None = None  # the token embedding's blocks; None: dequantized

    def matmul_bytes_per_param(self, dtype_bytes: int) -> float:
        dequantized = self.total_params - self.kept_params
        return (self.kept_bytes + dequantized * dtype_bytes) / max(1, self.total_params)


def model_size(
    hf_config: Any,
    dtype: str,
    cpu_blocks: GGUFBlockSizes | None = None,
    cpu_kv_dtype: str | None = None,
) -> ModelSize:
    """Sizes of a Llama-family (Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM2), MoE (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE) or OPT model; `cpu_kv_dtype`: what CPU workers' KV caches hold (None: dtype)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    # here, not at the top: the architectures' sizes build this module's ModelSize
    from hybridllm.plan.architecture_sizes import llama_size, mla_size, opt_size

    model_type = getattr(hf_config, "model_type", "") or ""
    if model_type == "opt":
        size = opt_size(hf_config, dtype)
    elif model_type in _MLA:
        size = mla_size(hf_config, dtype, model_type)
    elif model_type in _LLAMA_LIKE + _MOE or hasattr(hf_config, "intermediate_size"):
        size = llama_size(hf_config, dtype, model_type or "llama")
    else:
        raise ValueError(
            f"cannot size model_type {model_type!r}: supported are {', '.join(_LLAMA_LIKE)} and opt"
        )
    kv = None
    if cpu_kv_dtype not in (None, dtype):
        kv = size.kv_bytes_per_token_per_layer * DTYPE_BYTES[cpu_kv_dtype] // DTYPE_BYTES[dtype]
    windows = tuple(sliding_window_for_layer(hf_config, i) for i in range(size.num_layers))
    linear = tuple(is_linear_attention_layer(hf_config, i) for i in range(size.num_layers))
    return dataclasses.replace(
        size,
        cpu_blocks=cpu_blocks,
        cpu_kv_bytes_per_token_per_layer=kv,
        layer_windows=windows if any(w is not None for w in windows) else (),
        linear_layers=linear if any(linear) else (),
    )
