"""Tiny random DeepSeek-V2/V3, GLM-4.7-Flash (MLA) and GLM-4.5 models, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.model_helpers import make_tiny_tokenizer, random_eager_model

_COMMON = dict(
    vocab_size=320,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # peaky logits and router scores: greedy and top-k ties unlikely
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    hidden_size=96,
    intermediate_size=72,
    moe_intermediate_size=40,
    n_routed_experts=8,
    n_shared_experts=1,
)
_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    mscale=1.0,
    mscale_all_dim=1.0,
    beta_fast=32,
    beta_slow=1,
)

# model_type -> (HF config class, overrides)
DEEPSEEK_CONFIGS: dict[str, tuple[str, dict]] = {
    # no q low rank, softmax scores, V2's group limit (best expert per group), no renormalising
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(_COMMON, **_MLA, q_lora_rank=None, num_experts_per_tok=3, first_k_dense_replace=1,
             topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    ),
    # q low rank, sigmoid scores with the choice bias, 4 groups with 2 kept, a dense first
    # layer, YaRN with mscale_all_dim
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(_COMMON, **_MLA, q_lora_rank=48, num_experts_per_tok=3, first_k_dense_replace=1,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
             rope_parameters=_YARN),
    ),
    # v_head_dim differs from qk_nope_head_dim; dense layers from mlp_layer_types
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        dict(_COMMON, **dict(_MLA, v_head_dim=20), q_lora_rank=48, num_experts_per_tok=2,
             mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.8),
    ),
    # GQA, half the head rotated, q/k/v bias, q/k norm, V3's router
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(_COMMON, head_dim=24, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
             attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.0,
             partial_rotary_factor=0.5),
    ),
}  # fmt: skip
DEEPSEEK_ARCHITECTURES: tuple[str, ...] = tuple(DEEPSEEK_CONFIGS)


def tiny_deepseek_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    class_name, kwargs = DEEPSEEK_CONFIGS[arch]
    return getattr(transformers, class_name)(**{**kwargs, **overrides})


def build_tiny_deepseek_model(
    arch: str, seed: int = 0, **overrides
) -> transformers.PreTrainedModel:
    """A random fp32 HF model of `arch` (eager attention); norms, biases and the routers'
    choice biases perturbed so that loading them matters."""
    torch.manual_seed(seed)
    model = random_eager_model(tiny_deepseek_config(arch, **overrides))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


def make_tiny_deepseek_model(arch: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model (config, safetensors, tokenizer) under `path`."""
    path = Path(path)
    model = build_tiny_deepseek_model(arch, seed, **overrides)
    model.save_pretrained(path)
    make_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path
