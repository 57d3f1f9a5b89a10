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
    # the grid types (gguf_iq_blocks.h): d first; any byte is a valid index, sign or scale
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ1_M: (),  # d in the top nibbles of its four scale words: set_iq1_m_d
}


def set_iq1_m_d(raw: torch.Tensor, half: torch.Tensor) -> None:
    """IQ1_M keeps its fp16 d in the top nibbles of the four uint16 scale words (bytes 48-55)."""
    bits = half.view(torch.int16).to(torch.int32) & 0xFFFF  # [n]
    words = raw[:, 48:56].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 4]
    for j in range(4):
        words[:, j] = (words[:, j] & 0x0FFF) | (((bits >> (4 * j)) & 0xF) << 12)
    raw[:, 48:56] = words.to(torch.int16).view(torch.uint8).view(-1, 8)


def random_blocks(ggml_type: int, rows: int, K: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, K / block_size * block_bytes] uint8: `rows` weight rows of K weights."""
    block_size, block_bytes = GGML_QUANT_SIZES[Q(ggml_type)]
    assert K % block_size == 0, f"K={K} is not a multiple of {block_size}"
    if ggml_type not in FP16_OFFSETS:
        raise NotImplementedError(f"no fp16 offsets for ggml_type {ggml_type}: add them above")
    n = rows * K // block_size
    raw = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=generator)

    def small_halves() -> torch.Tensor:
        magnitude = torch.empty(n).uniform_(1e-3, 0.1, generator=generator)
        sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
        return (magnitude * sign).half()

    for offset in FP16_OFFSETS[ggml_type]:
        raw[:, offset : offset + 2] = small_halves().view(torch.uint8).view(n, 2)
    if ggml_type == Q.IQ1_M:
        set_iq1_m_d(raw, small_halves())
    return raw.reshape(rows, -1)
