"""Random but valid GGUF blocks of the types computed as code blocks, for the kernel tests.

Every byte random except the fp16 fields (d, dmin), which are set to small normal halves so
that products stay finite and no scale is subnormal.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# Byte offsets of each type's fp16 fields within its block (gguf/quants.py's layouts).
FP16_OFFSETS: dict[int, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),  # d, dmin after 16 scale bytes and 64 bytes of 2-bit q
    Q.Q3_K: (108,),  # d after hmask, q and 12 scale bytes
    Q.IQ4_XS: (0,),  # d first
    # The grid types (gguf_iq_blocks.h): their fp16 offsets here, and below whatever else a
    # random byte may not hold (e.g. a grid index past the grid's end).
}


def random_blocks(ggml_type: int, rows: int, K: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, K / block_size * block_bytes] uint8: `rows` weight rows of K weights."""
    block_size, block_bytes = GGML_QUANT_SIZES[Q(ggml_type)]
    assert K % block_size == 0, f"K={K} is not a multiple of {block_size}"
    if ggml_type not in FP16_OFFSETS:
        raise NotImplementedError(f"no fp16 offsets for ggml_type {ggml_type}: add them above")
    n = rows * K // block_size
    raw = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=generator)
    for offset in FP16_OFFSETS[ggml_type]:
        magnitude = torch.empty(n).uniform_(1e-3, 0.1, generator=generator)
        sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
        half = (magnitude * sign).half()
        raw[:, offset : offset + 2] = half.view(torch.uint8).view(n, 2)
    return raw.reshape(rows, -1)
