"""A model's Hugging Face config.json, read without importing transformers' config classes.

transformers' `AutoConfig` pulls in torch._dynamo and torch.distributed.tensor on import,
about 2.3 s of a 2-core machine's cold start; the engine needs a few dozen plain fields.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hybridllm.loader.model_source import ModelLoadError

CONFIG_FILE = "config.json"

_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 10000.0,
}
_LINEAR_ATTENTION_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS,
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
_LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_moe_text")
_LINEAR_SIZES = (
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# What transformers' config classes assume when config.json omits a field the engine reads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "head_dim": 128,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mixtral": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
    "olmoe": {
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "clip_qkv": None,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
    "gemma2": {
        **_LLAMA_DEFAULTS,
        "vocab_size": 256000,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    # Gemma 3's multimodal folders give only what differs from these (gemma-3-4b-it: 6 fields)
    "gemma3_text": {
        **_LLAMA_DEFAULTS,
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    "gpt_oss": {
        **_LLAMA_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "head_dim": 64,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "num_experts_per_tok": 4,
        "rope_theta": 150000.0,
    },
    # Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet layers with a full-attention one every
    # `full_attention_interval`, rotating a quarter of each head, sigmoid-gated shared expert
    "qwen3_next": {
        **_LINEAR_ATTENTION_DEFAULTS,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_5_moe_text": {
        **_LINEAR_ATTENTION_DEFAULTS,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,  # its router always renormalises
    },
    "opt": {
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
    },
}
_ALTERNATING = ("gemma2", "gemma3_text", "gpt_oss")
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
_REQUIRED_BY_TYPE = {"opt": ("ffn_dim",)}
_ROPE_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    *_LINEAR_ATTENTION,
)


class HFConfig:
    """Read-only attribute view of a config.json dict, with the defaults transformers applies.

    Missing optional fields raise AttributeError, so `getattr(config, name, default)` works as
    with transformers' configs. Rope settings are also offered in transformers 5's form,
    `rope_parameters` (rope_theta plus any scaling), whichever form the file used.
    """

    def __init__(self, values: dict[str, Any], origin: str = CONFIG_FILE):
        values = _text_part(values)
        model_type = values.get("model_type")
        merged = {**_DEFAULTS.get(model_type, {}), **values}
        if model_type in _DEFAULTS:
            for key in _REQUIRED + _REQUIRED_BY_TYPE.get(model_type, ()):
                if merged.get(key) is None:
                    raise ModelLoadError(f"{origin}: model_type {model_type!r} needs {key!r}")
        if model_type in _ROPE_TYPES and not merged.get("rope_parameters"):
            merged["rope_parameters"] = _rope_parameters(merged)
        if model_type in _LINEAR_ATTENTION:
            _linear_attention_fields(merged)
        if model_type in ("qwen2", "qwen3") and merged.get("layer_types") is None:
            # transformers derives each layer's kind the same way when the file does not say
            sliding_from = merged["max_window_layers"] if merged["use_sliding_window"] else None
            merged["layer_types"] = [
                "sliding_attention"
                if sliding_from is not None and i >= sliding_from
                else "full_attention"
                for i in range(merged["num_hidden_layers"])
            ]
        if model_type in _ALTERNATING and merged.get("layer_types") is None:
            # Gemma 2 and gpt-oss alternate sliding and global layers; Gemma 3 has one global
            # layer in each `sliding_window_pattern`
            pattern = 2 if model_type != "gemma3_text" else _sliding_pattern(merged)
            merged["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(merged["num_hidden_layers"])
            ]
        object.__setattr__(self, "_values", merged)

    @classmethod
    def from_file(cls, path: str) -> HFConfig:
        """Parse a config.json; an unreadable or non-object file raises ModelLoadError."""
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None
        if not isinstance(values, dict):
            raise ModelLoadError(f"{path}: not a JSON object")
        return cls(values, origin=path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":  # pickling probes before _values exists
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")

    def __getstate__(self) -> dict[str, Any]:
        return self._values

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFConfig) and self._values == other._values

    def __repr__(self) -> str:
        return f"HFConfig({self._values.get('model_type')!r}, {len(self._values)} fields)"

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._values))  # a deep copy the caller may change

    def save_pretrained(self, folder: str) -> None:
        """Write config.json into `folder` (as transformers' configs do)."""
        with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(self._values, f, indent=1, sort_keys=True)


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    scaling = dict(values.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    return {**scaling, "rope_type": rope_type, "rope_theta": values["rope_theta"]}


# multimodal model_type -> its language model's, whose config is the folder's `text_config`
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _text_part(values: dict[str, Any]) -> dict[str, Any]:
    """A multimodal folder's language model config (Gemma 3's or Qwen3.5's `text_config`),
    keeping the folder's `architectures`; any other config as it is."""
    text = values.get("text_config")
    text_type = _TEXT_MODEL_TYPES.get(values.get("model_type"))
    if text_type is None or not isinstance(text, dict):
        return values
    return {"model_type": text_type, **text, "architectures": values.get("architectures")}


def _linear_attention_fields(merged: dict[str, Any]) -> None:
    """Qwen3-Next / Qwen3.5: each layer's kind from `full_attention_interval` where the file
    lists none (transformers derives it so), and the rotated fraction of each head inside
    `rope_parameters` (older files keep `partial_rotary_factor` beside `rope_theta`)."""
    if merged.get("layer_types") is None:
        interval = merged["full_attention_interval"]
        if not isinstance(interval, int) or interval < 1:
            raise ModelLoadError(
                f"full_attention_interval must be a positive integer, got {interval!r}"
            )
        merged["layer_types"] = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(merged["num_hidden_layers"])
        ]
    kinds = merged["layer_types"]
    if (
        not isinstance(kinds, list)
        or len(kinds) != merged["num_hidden_layers"]
        or not set(kinds) <= {"linear_attention", "full_attention"}
    ):
        raise ModelLoadError(
            "layer_types must list 'linear_attention' or 'full_attention' for each of the "
            f"{merged['num_hidden_layers']} layers"
        )
    for key in _LINEAR_SIZES:
        value = merged[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"{key} must be a positive integer, got {value!r}")
    if merged["linear_num_value_heads"] % merged["linear_num_key_heads"]:
        raise ModelLoadError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    rope = dict(merged["rope_parameters"])
    rope.setdefault("partial_rotary_factor", merged["partial_rotary_factor"])
    factor = rope["partial_rotary_factor"]
    if (
        not isinstance(factor, (int, float))
        or isinstance(factor, bool)
        or not 0 < factor <= 1
        or int(merged["head_dim"] * factor) % 2
    ):
        raise ModelLoadError(
            f"partial_rotary_factor must be in (0, 1] and rotate an even number of each head's "
            f"{merged['head_dim']} dimensions, got {factor!r}"
        )
    merged["rope_parameters"] = rope


def _sliding_pattern(values: dict[str, Any]) -> int:
    pattern = values.get("_sliding_window_pattern") or values.get("sliding_window_pattern")
    if not isinstance(pattern, int) or pattern < 1:
        raise ModelLoadError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return pattern
