"""Maps HF `architectures` names to model classes (imported lazily)."""

from __future__ import annotations

import importlib

# architecture -> (module, class); a tuple of pairs keeps the table immutable
_MODELS = (
    ("LlamaForCausalLM", ("hybridllm.models.llama", "LlamaForCausalLM")),
    ("MistralForCausalLM", ("hybridllm.models.mistral", "MistralForCausalLM")),
    ("Qwen2ForCausalLM", ("hybridllm.models.qwen2", "Qwen2ForCausalLM")),
    ("Qwen3ForCausalLM", ("hybridllm.models.qwen3", "Qwen3ForCausalLM")),
    ("OPTForCausalLM", ("hybridllm.models.opt", "OPTForCausalLM")),
    ("MixtralForCausalLM", ("hybridllm.models.mixtral", "MixtralForCausalLM")),
    ("Qwen2MoeForCausalLM", ("hybridllm.models.qwen2_moe", "Qwen2MoeForCausalLM")),
    ("Qwen3MoeForCausalLM", ("hybridllm.models.qwen3_moe", "Qwen3MoeForCausalLM")),
    ("OlmoeForCausalLM", ("hybridllm.models.olmoe", "OlmoeForCausalLM")),
    ("DeepseekV2ForCausalLM", ("hybridllm.models.deepseek_v2", "DeepseekV2ForCausalLM")),
    ("DeepseekV3ForCausalLM", ("hybridllm.models.deepseek_v2", "DeepseekV3ForCausalLM")),
    ("Glm4MoeLiteForCausalLM", ("hybridllm.models.deepseek_v2", "Glm4MoeLiteForCausalLM")),
    ("Glm4MoeForCausalLM", ("hybridllm.models.glm4_moe", "Glm4MoeForCausalLM")),
    ("MiniMaxM2ForCausalLM", ("hybridllm.models.minimax_m2", "MiniMaxM2ForCausalLM")),
    ("GptOssForCausalLM", ("hybridllm.models.gpt_oss", "GptOssForCausalLM")),
    ("Gemma2ForCausalLM", ("hybridllm.models.gemma", "Gemma2ForCausalLM")),
    ("Gemma3ForCausalLM", ("hybridllm.models.gemma", "Gemma3ForCausalLM")),
    ("Gemma3ForConditionalGeneration", ("hybridllm.models.gemma", "Gemma3ForCausalLM")),
    ("Qwen3NextForCausalLM", ("hybridllm.models.qwen3_next", "Qwen3NextForCausalLM")),
    ("Qwen3_5MoeForCausalLM", ("hybridllm.models.qwen3_next", "Qwen3NextForCausalLM")),
    (
        "Qwen3_5MoeForConditionalGeneration",
        ("hybridllm.models.qwen3_next", "Qwen3NextForCausalLM"),
    ),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(name for name, _ in _MODELS)


def get_model_class(architecture: str) -> type:
    """The model class implementing the HF architecture name (e.g. "LlamaForCausalLM")."""
    location = dict(_MODELS).get(architecture)
    if location is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, cls = location
    return getattr(importlib.import_module(module), cls)
