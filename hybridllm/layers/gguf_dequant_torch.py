"""GGUF block decoding in torch, on whatever device holds the blocks.

A streamed CPU layer crosses the link as its GGUF blocks (about 4x fewer bytes than bf16) and
the accelerator decodes them into its staging slot. Each decoder computes what llama.cpp's (and
`gguf.quants.dequantize`) computes, `d * q (+ m)` in float32, so results match the host decode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((packed & 15, packed >> 4), dim=-1).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # f16 d, 32 x int8
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # f16 d, 16 bytes of nibbles; (q - 8) * d
    return (_nibbles(b[:, 2:]) - 8) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # f16 d, f16 m, 16 bytes of nibbles; q * d + m
    return _nibbles(b[:, 4:]) * _f16(b, 0) + _f16(b, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, each [n, 8] float32."""
    s = scales.view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc.float(), mn.float()


def _low_high(qs: torch.Tensor, n: int) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32]: each 32-byte run gives a sub-block of low nibbles, then
    one of high nibbles."""
    shifted = qs.view(n, 4, 1, 32) >> _shifts((0, 4), qs.device).view(1, 1, 2, 1)
    return (shifted & 15).view(n, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, 12 scale bytes, 128 nibble bytes
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    q = _low_high(b[:, 16:144], n).float()  # [n, 8, 32]
    d, dmin = _f16(b, 0), _f16(b, 2)
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).view(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, scales, 32 high-bit bytes, 128 nibbles
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    high = b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(tuple(range(8)), b.device).view(1, 1, 8, 1)
    q = _low_high(b[:, 48:176], n) | ((high & 1).view(n, 8, 32) << 4)
    d, dmin = _f16(b, 0), _f16(b, 2)
    return ((d * sc)[..., None] * q.float() - (dmin * mn)[..., None]).view(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 128 low-nibble, 64 high-bit, 16 int8 scales, d
    n = b.shape[0]
    low = b[:, :128].reshape(n, 2, 1, 64) >> _shifts((0, 4), b.device).view(1, 1, 2, 1)
    low = (low & 15).reshape(n, 8, 32)
    high = b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), b.device).view(1, 1, 4, 1)
    high = (high & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).view(torch.int8) - 32  # [n, 8, 32] in [-32, 31]
    scales = b[:, 192:208].contiguous().view(torch.int8).float() * _f16(b, 208)  # [n, 16]
    return (scales[..., None] * q.view(n, 16, 16).float()).view(n, 256)


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
TORCH_DECODED_TYPES: frozenset[int] = frozenset(int(t) for t in _DECODERS)


def dequantize_torch(blocks: torch.Tensor, ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks [rows, bytes_per_row] uint8 (any device) -> float32 [rows, cols] there."""
    decoder = _DECODERS.get(int(ggml_type))
    if decoder is None:
        raise ValueError(f"no torch decoder for GGUF type {Q(ggml_type).name}")
    block_elems, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    values = decoder(blocks.reshape(-1, type_size))  # [rows * cols / block, block]
    return values.view(rows, cols)
