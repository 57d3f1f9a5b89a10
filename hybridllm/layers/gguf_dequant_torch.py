"""GGUF block decoding in torch, on whatever device holds the blocks.

A streamed CPU layer crosses the link as its GGUF blocks (about 4x fewer bytes than bf16) and
the accelerator decodes them into its staging slot. Each decoder computes what llama.cpp's (and
`gguf.quants.dequantize`) computes, in float32 and in the same order of roundings, so results
match the host decode bit for bit. A decoder works on all of a weight's blocks at once (a few
kernel launches per weight, no loop over blocks); the grid types (IQ2/IQ3/IQ1) are in
`gguf_dequant_torch_iq.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, MXFP4

from hybridllm.layers.gguf_dequant_torch_iq import IQ_DECODERS, const, f16, nibble_pairs

Q = GGMLQuantizationType
_f16 = f16


def _shifts(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return const(values, torch.uint8, device)


def _nibble_codes(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] uint8: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return _nibble_codes(packed).float()


def _bits32(packed: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] uint8: bit i is element i."""
    return ((packed[:, :, None] >> _shifts(tuple(range(8)), packed.device)) & 1).reshape(-1, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # f16 d, 32 x int8
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # f16 d, 16 bytes of nibbles; (q - 8) * d
    return (_nibbles(b[:, 2:]) - 8) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # f16 d, f16 m, 16 bytes of nibbles; q * d + m
    return _nibbles(b[:, 4:]) * _f16(b, 0) + _f16(b, 2)


def _q5(b: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes [n, 32] in 0..31: a uint32 of fifth bits at `start`, 16 nibble bytes."""
    return _nibble_codes(b[:, start + 4 :]) | (_bits32(b[:, start : start + 4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # f16 d, 4 high-bit bytes, 16 nibbles; d * (q - 16)
    return _f16(b, 0) * (_q5(b, 2).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # f16 d, f16 m, 4 high-bit bytes, 16 nibbles
    return _f16(b, 0) * _q5(b, 4).float() + _f16(b, 2)


@functools.cache
def _kvalues(device: torch.device) -> torch.Tensor:
    """IQ4_NL's and IQ4_XS's 16 non-linear levels, float32 on `device`."""
    return torch.tensor(IQ4_NL.kvalues, dtype=torch.float32, device=device)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # f16 d, 16 bytes of nibbles indexing kvalues
    return _f16(b, 0) * _kvalues(b.device)[_nibble_codes(b[:, 2:]).long()]


@functools.cache
def _mxfp4_values(device: torch.device) -> torch.Tensor:
    """MXFP4's 16 E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and negatives), float32."""
    return torch.tensor(MXFP4.kvalues, dtype=torch.float32, device=device)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes [n, 1] as half their power of two, 2^(e - 128), float32 [n, 1]:
    (e - 1) << 23 as float bits, or the subnormals 2^-128, 2^-127 for e = 0, 1 (gguf's
    e8m0_to_fp32_half; the native kernels' e8m0_half_to_float)."""
    e = e.int()
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # E8M0 byte, 16 bytes of nibbles (IQ4_NL's order)
    return _e8m0_half(b[:, :1]) * _mxfp4_values(b.device)[_nibble_codes(b[:, 1:]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """f16 d, a uint16 of 2-bit scale highs, 4 bytes of scale nibbles, 8 x 16 bytes of nibbles;
    each 32 weights are d * (scale - 32) * kvalues[q]."""
    n = b.shape[0]
    high = (b[:, 2:4, None] >> _shifts((0, 2, 4, 6), b.device)) & 3  # [n, 2, 4]
    scales = nibble_pairs(b[:, 4:8]) | (high.reshape(n, 8) << 4)
    dl = _f16(b, 0) * (scales.float() - 32)  # [n, 8]
    q = (b[:, 8:136].reshape(n, 8, 1, 16) >> _shifts((0, 4), b.device).view(1, 1, 2, 1)) & 15
    return (dl[..., None] * _kvalues(b.device)[q.reshape(n, 8, 32).long()]).view(n, 256)


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


def _crumbs(qs: torch.Tensor, n: int) -> torch.Tensor:
    """Q2_K/Q3_K: [n, 64] bytes -> [n, 16, 16] 2-bit codes: each 32-byte run gives four
    sub-blocks of 32, bits 0-1 of every byte first, then bits 2-3, 4-5, 6-7."""
    shifted = qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), qs.device).view(1, 1, 4, 1)
    return (shifted & 3).view(n, 16, 16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # 16 scale/min bytes, 64 code bytes, d, dmin
    n = b.shape[0]
    sc = b[:, :16]
    dl = _f16(b, 80) * (sc & 15).float()  # [n, 16]
    ml = _f16(b, 82) * (sc >> 4).float()
    return (dl[..., None] * _crumbs(b[:, 16:80], n).float() - ml[..., None]).view(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # 32 high-bit bytes, 64 code bytes, 12 scales, d
    n = b.shape[0]
    sc = b[:, 96:108]
    low = (sc[:, None, :8] >> _shifts((0, 4), b.device).view(1, 2, 1)) & 15  # [n, 2, 8]
    high = (sc[:, None, 8:] >> _shifts((0, 2, 4, 6), b.device).view(1, 4, 1)) & 3  # [n, 4, 4]
    scales = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).float() - 32
    dl = _f16(b, 108) * scales  # [n, 16]
    hmask = b[:, :32].reshape(n, 1, 32) >> _shifts(tuple(range(8)), b.device).view(1, 8, 1)
    minus4 = ((hmask & 1) ^ 1).view(n, 16, 16) << 2  # 4 where the high bit is clear
    q = _crumbs(b[:, 32:96], n).float() - minus4.float()
    return (dl[..., None] * q).view(n, 256)


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
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.IQ4_NL: _iq4_nl,
    Q.MXFP4: _mxfp4,
    Q.IQ4_XS: _iq4_xs,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    **IQ_DECODERS,
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
