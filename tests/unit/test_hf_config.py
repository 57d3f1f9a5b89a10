"""HFConfig: config.json read without transformers, with the defaults transformers applies."""

from __future__ import annotations

import json
import pickle

import pytest
from transformers import AutoConfig

from hybridllm.loader.hf_config import HFConfig
from hybridllm.loader.model_source import ModelLoadError

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 100,
}

# The fields the engine reads; each must agree with transformers' config class.
_READ = (
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "head_dim",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "rope_parameters",
    "do_layer_norm_before",
    "activation_function",
    "enable_bias",
    "layer_norm_elementwise_affine",
)


@pytest.mark.parametrize(
    "values",
    [
        LLAMA,
        {**LLAMA, "rope_theta": 500000.0, "tie_word_embeddings": True},
        {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"]},
        {**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
        {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
        {**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        {
            "model_type": "opt",
            "architectures": ["OPTForCausalLM"],
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 100,
        },
    ],
)
def test_fields_match_transformers(values):
    ours = HFConfig(values)
    reference = AutoConfig.for_model(**values)
    for key in _READ:
        if hasattr(reference, key) and getattr(reference, key) is not None:
            expected = getattr(reference, key)
            if key == "head_dim" and values["model_type"] != "qwen3":
                continue  # transformers fills hidden/heads; the engine derives the same
            assert getattr(ours, key) == expected, key


def test_missing_required_field_names_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'hidden_size'"):
        HFConfig.from_file(str(path))


def test_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        HFConfig.from_file(str(path))


def test_read_only_attribute_access_and_pickling(tmp_path):
    config = HFConfig(LLAMA)
    assert getattr(config, "no_such_field", "fallback") == "fallback"
    with pytest.raises(AttributeError, match="read-only"):
        config.hidden_size = 3
    assert pickle.loads(pickle.dumps(config)) == config
    config.save_pretrained(str(tmp_path))
    assert HFConfig.from_file(str(tmp_path / "config.json")) == config
    copy = config.to_dict()
    copy["hidden_size"] = 1
    assert config.hidden_size == 64
