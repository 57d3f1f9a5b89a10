"""The planner's sizes of DeepSeek-V2/V3, GLM-4.7-Flash and GLM-4.5 against the real models."""

from __future__ import annotations

import pytest

from hybridllm.plan.model_size import model_size
from tests.deepseek_helpers import DEEPSEEK_ARCHITECTURES, build_tiny_deepseek_model


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHITECTURES)
def test_parameter_bytes_equal_the_hf_models(arch):
    hf = build_tiny_deepseek_model(arch)
    size = model_size(hf.config, "float32")
    params = sum(p.numel() for p in hf.parameters())
    assert size.total_bytes == 4 * params
    # every layer, dense or sparse, as the model holds it
    for i, layer in enumerate(hf.model.layers):
        assert size.layer_weight_bytes(i) == 4 * sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_mla_kv_bytes_are_the_latent(arch):
    config = build_tiny_deepseek_model(arch).config
    size = model_size(config, "bfloat16")
    # kv_lora_rank + qk_rope_head_dim values, not heads x (key + value)
    assert size.kv_bytes_per_token_per_layer == 2 * (config.kv_lora_rank + config.qk_rope_head_dim)
    assert size.kv_bytes_per_token(config.num_hidden_layers) == (
        config.num_hidden_layers * 2 * (32 + 8)
    )
