"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, Lark) via llguidance."""

from hybridllm.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
