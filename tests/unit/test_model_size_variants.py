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
