"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from hybridllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_options(self, hf_config: Any) -> tuple[bool, bool, bool]:
        return True, False, False  # qkv bias, no o_proj bias, no q/k norm
