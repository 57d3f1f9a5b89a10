"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from typing import Any

from hybridllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, True
