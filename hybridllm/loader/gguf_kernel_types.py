"""GGUF block types of the native kernels' table (HYBRIDLLM_GGUF_TYPES, csrc/gguf_types.h), for
Python code and tests that need them without a build.

CODE_BLOCK_TYPES mirrors the table's lines with kCodeBlocks: the types whose kernels are the
generic code-block ones (csrc/gguf_code_blocks.h), each bringing only its decoder. Adding a line
there means adding its type here (tests/unit/test_gguf_code_block_kernels.py checks the two
agree, and runs every kernel on every type listed).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

_Q = GGMLQuantizationType

# Computed as code blocks: decoders in gguf_code_decoders.h (Q2_K, Q3_K, IQ4_XS) and
# gguf_iq_blocks.h (the grid types).
CODE_BLOCK_TYPES: tuple[int, ...] = tuple(
    int(t)
    for t in (
        _Q.Q2_K,
        _Q.Q3_K,
        _Q.IQ4_XS,
        _Q.IQ2_XXS,
        _Q.IQ2_XS,
        _Q.IQ2_S,
        _Q.IQ3_XXS,
        _Q.IQ3_S,
        _Q.IQ1_S,
        _Q.IQ1_M,
    )
)

# The table's other ggml types, each with kernels of its own.
OWN_KERNEL_TYPES: tuple[int, ...] = tuple(
    int(t)
    for t in (
        _Q.F32,
        _Q.F16,
        _Q.BF16,
        _Q.Q4_0,
        _Q.Q4_1,
        _Q.Q5_0,
        _Q.Q5_1,
        _Q.Q8_0,
        _Q.IQ4_NL,
        _Q.MXFP4,
        _Q.Q4_K,
        _Q.Q5_K,
        _Q.Q6_K,
    )
)

# The block types a CPU worker with the native kernels keeps and computes as blocks: every
# quantized type of the table, and F16 / BF16 (half of fp32's bytes; plain F32 weights are
# floats anyway).
GGUF_KERNEL_TYPES: frozenset[int] = frozenset(CODE_BLOCK_TYPES + OWN_KERNEL_TYPES) - {int(_Q.F32)}


def kept_as_blocks(ggml_type: int, row_length: int) -> bool:
    """Whether a CPU worker with the native kernels keeps a weight of `ggml_type` whose rows
    hold `row_length` weights as blocks: a kernel type, in rows of whole 32-weight blocks
    (always true of block types; F16 / BF16 weights may have any row length)."""
    return ggml_type in GGUF_KERNEL_TYPES and row_length % 32 == 0
