"""The planner's sizes of Gemma 2/3, gpt-oss and MiniMax-M2 equal the parameters of the
transformers models (tiny random configs), layer by layer."""

from __future__ import annotations

import pytest

from hybridllm.plan.model_size import model_size
from tests.model_helpers import build_tiny_hf_model


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt_oss", "minimax_m2"])
def test_parameter_bytes_equal_the_hf_models(arch):
    hf = build_tiny_hf_model(arch)
    size = model_size(hf.config, "float32")
    assert size.total_bytes == 4 * sum(p.numel() for p in hf.parameters())
    for i, layer in enumerate(hf.model.layers):
        assert size.layer_weight_bytes(i) == 4 * sum(p.numel() for p in layer.parameters())


def test_an_mxfp4_folder_keeps_its_experts_as_17_byte_blocks():
    from hybridllm.loader.block_sizes import mxfp4_expert_sizes
    from hybridllm.loader.hf_config import HFConfig

    config = build_tiny_hf_model("gpt_oss").config.to_dict()
    assert mxfp4_expert_sizes(HFConfig(config)) is None  # a bf16 folder: floats
    config["quantization_config"] = {"quant_method": "mxfp4"}
    sizes = mxfp4_expert_sizes(HFConfig(config))
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    routed = layers * experts * 3 * config["hidden_size"] * config["intermediate_size"]
    assert (sizes.kept_params, sizes.kept_bytes) == (routed, routed * 17 // 32)
    assert sizes.total_params > routed and sizes.lm_head_bytes is None


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_linear_attention_models_sizes_equal_the_hf_models(arch):
    """Gated DeltaNet and gated-attention layers sized apart, each equal to transformers'; the
    state is the layer's conv and recurrent state in fp32, counted per sequence, not per token."""
    from hybridllm.layers.gated_delta_net import DeltaNetShape, DeltaNetState

    hf = build_tiny_hf_model(arch)
    size = model_size(hf.config, "float32")
    assert size.total_bytes == 4 * sum(p.numel() for p in hf.parameters())
    for i, layer in enumerate(hf.model.layers):
        assert size.layer_weight_bytes(i) == 4 * sum(p.numel() for p in layer.parameters())
    assert size.linear_layers == (True, True, True, False)
    per_seq = 4 * DeltaNetState.floats_per_slot(DeltaNetShape.from_hf(hf.config))
    assert size.state_bytes(0, 4, max_num_seqs=5) == 3 * 5 * per_seq
    assert size.full_attention_layers(0, 4) == 1
    assert size.attended_context(0, 4, 100) == 100  # only the full layer reads keys
