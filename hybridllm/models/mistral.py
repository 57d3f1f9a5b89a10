"""Mistral: the Llama decoder with (optional) sliding-window attention on every layer."""

from __future__ import annotations

from hybridllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """No biases; `sliding_window` from the config is applied by each attention layer."""
