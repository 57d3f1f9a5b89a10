"""Each architecture family's ModelSize from its HF config: the Llama family and the mixtures
of experts on its decoder (Qwen3-Next's Gated DeltaNet layers among them), MLA models, OPT."""

from __future__ import annotations

from typing import Any

from hybridllm.plan.model_size import DTYPE_BYTES, ModelSize
from hybridllm.plan.moe_size import moe_size

# Gated DeltaNet layers beside gated full attention: a fixed state per sequence, no KV
LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_moe_text")


def llama_size(c: Any, dtype: str, model_type: str) -> ModelSize:
    b = DTYPE_BYTES[dtype]
    hidden, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    # Qwen2 always biases q/k/v; Llama/Qwen3 only with attention_bias (then o_proj too).
    attention_bias = bool(getattr(c, "attention_bias", False))
    qwen2 = model_type in ("qwen2", "qwen2_moe")
    qkv_bias = qwen2 or attention_bias
    o_bias = attention_bias and not qwen2 and model_type != "glm4_moe"
    moe = moe_size(c)
    mlp = 3 * hidden * inter
    if moe is not None:  # the largest layer's MLP; `inter` sizes the activation workspace
        mlp = max(moe.mlp_params(i) for i in range(c.num_hidden_layers))
        inter = moe.activation_width
    matmul = hidden * (q + 2 * kv) + q * hidden + mlp
    extra = 2 * hidden  # input and post-attention RMSNorm
    extra += (q + 2 * kv) if qkv_bias else 0
    extra += hidden if o_bias else 0
    extra += (2 * inter + hidden) if getattr(c, "mlp_bias", False) else 0
    qk_norm = model_type in ("qwen3", "qwen3_moe") or getattr(c, "use_qk_norm", False)
    extra += 2 * head_dim if qk_norm else 0  # per-head q/k RMSNorm
    # OLMoE's and MiniMax-M2's q/k RMSNorm over all heads
    extra += (q + kv) if model_type in ("olmoe", "minimax_m2") else 0
    if model_type in ("gemma2", "gemma3_text"):
        extra += 2 * hidden  # the norms before and after the MLP
        extra += 2 * head_dim if model_type == "gemma3_text" else 0
    linear_params = linear_extra = state_floats = 0
    if model_type in LINEAR_ATTENTION:
        # gated attention: q_proj also gives each head's output gate; q/k norms
        matmul += hidden * q
        extra += 2 * head_dim
        linear_params, linear_extra, state_floats = gated_deltanet_sizes(c)
        linear_extra += 2 * hidden  # input and post-attention RMSNorm
    if model_type == "gpt_oss" and moe is not None:
        # sinks, router bias, the experts' gate/up and down biases
        extra += heads + moe.num_experts * (1 + 2 * moe.expert_intermediate + hidden)
    return ModelSize(
        model_type=model_type,
        dtype=dtype,
        num_layers=c.num_hidden_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        layer_bytes=(matmul + extra) * b,
        embedding_bytes=vocab * hidden * b,
        final_norm_bytes=hidden * b,
        lm_head_bytes=vocab * hidden * b,
        matmul_params_per_layer=matmul,
        kv_bytes_per_token_per_layer=2 * kv * b,
        mlp_matrices=3,
        layer_other_bytes=extra * b,
        moe=moe,
        gated_query=model_type in LINEAR_ATTENTION,
        linear_attention_params=linear_params,
        linear_other_bytes=linear_extra * b,
        state_bytes_per_layer=4 * state_floats,
    )


def gated_deltanet_sizes(c: Any) -> tuple[int, int, int]:
    """(matmul parameters, other parameters, fp32 state values per sequence) of one Gated
    DeltaNet layer (layers/gated_delta_net.py)."""
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    key, value = k_heads * c.linear_key_head_dim, v_heads * c.linear_value_head_dim
    conv_dim, kernel = 2 * key + value, c.linear_conv_kernel_dim
    hidden = c.hidden_size
    matmul = hidden * (conv_dim + value + 2 * v_heads) + value * hidden
    other = conv_dim * kernel + 2 * v_heads + c.linear_value_head_dim
    state = conv_dim * (kernel - 1) + v_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return matmul, other, state


def mla_size(c: Any, dtype: str, model_type: str) -> ModelSize:
    """DeepSeek-V2/V3-style sizes: latent attention, DeepSeek's experts (moe_size)."""
    b = DTYPE_BYTES[dtype]
    hidden, heads, vocab = c.hidden_size, c.num_attention_heads, c.vocab_size
    nope, rope, v, latent = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q_rank = getattr(c, "q_lora_rank", None)
    q = heads * (nope + rope)
    q_params = hidden * q_rank + q_rank * q if q_rank else hidden * q
    attention = (
        q_params + hidden * (latent + rope) + latent * heads * (nope + v) + heads * v * hidden
    )
    moe = moe_size(c)
    mlp = max(moe.mlp_params(i) for i in range(c.num_hidden_layers))
    extra = 2 * hidden + latent + (q_rank or 0)  # layer norms, kv_a and q_a RMSNorms
    if getattr(c, "attention_bias", False):
        extra += (q_rank or 0) + latent + rope + hidden
    return ModelSize(
        model_type=model_type,
        dtype=dtype,
        num_layers=c.num_hidden_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=1,  # one latent row serves every head
        head_dim=nope + rope,
        intermediate_size=moe.activation_width,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        layer_bytes=(attention + mlp + extra) * b,
        embedding_bytes=vocab * hidden * b,
        final_norm_bytes=hidden * b,
        lm_head_bytes=vocab * hidden * b,
        matmul_params_per_layer=attention + mlp,
        kv_bytes_per_token_per_layer=(latent + rope) * b,
        mlp_matrices=3,
        layer_other_bytes=extra * b,
        moe=moe,
        mla_attention_params=attention,
    )


def opt_size(c: Any, dtype: str) -> ModelSize:
    b = DTYPE_BYTES[dtype]
    hidden, ffn, vocab = c.hidden_size, c.ffn_dim, c.vocab_size
    heads = c.num_attention_heads
    proj = getattr(c, "word_embed_proj_dim", None) or hidden
    bias = bool(getattr(c, "enable_bias", True))
    norm = (2 * hidden) if getattr(c, "layer_norm_elementwise_affine", True) else 0
    matmul = 4 * hidden * hidden + 2 * hidden * ffn
    extra = 2 * norm + ((4 * hidden + ffn + hidden) if bias else 0)
    positions = (c.max_position_embeddings + 2) * hidden  # OPT's learned table starts 2 rows in
    project = proj * hidden if proj != hidden else 0  # project_in / project_out, no bias
    # OPT-350m (post-LN) has no final layer norm.
    final_norm = norm if getattr(c, "do_layer_norm_before", True) else 0
    return ModelSize(
        model_type="opt",
        dtype=dtype,
        num_layers=c.num_hidden_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=ffn,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        layer_bytes=(matmul + extra) * b,
        embedding_bytes=(vocab * proj + positions + project) * b,
        final_norm_bytes=(final_norm + project) * b,
        lm_head_bytes=vocab * proj * b,
        matmul_params_per_layer=matmul,
        kv_bytes_per_token_per_layer=2 * hidden * b,
        mlp_matrices=2,
        layer_other_bytes=extra * b,
    )
