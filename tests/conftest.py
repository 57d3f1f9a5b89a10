"""Test-session settings shared by every test module."""

from __future__ import annotations

import os

# GGUF linears compute with fp32 activations, exact against the dequantized weights, which the
# tests comparing block-computed models with float ones rely on; tests of the int8 path ask for
# it themselves. `HYBRIDLLM_GGUF_ACTIVATIONS=int8 pytest ...` runs the suite on the int8 path.
os.environ.setdefault("HYBRIDLLM_GGUF_ACTIVATIONS", "fp32")
