"""GGUF's grid types decoded in torch: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Each group of 8 (IQ2, IQ1) or 4 (IQ3) weights is one row of a small lattice ("grid"), picked
by an 8- to 11-bit index, times a per-sub-block scale, with signs from a bit mask (IQ2, IQ3) or
an offset of +-1/8 (IQ1). The grids come from `gguf.quants` (its `init_grid` data), built once
per device; a decoder gathers a whole weight's rows from them in one indexing op and scales
them in place. Each float32 product is the one `gguf.quants.dequantize` rounds (a sign flip is
exact), so results are equal bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType


@functools.cache
def const(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor (shift amounts), made once per device. Never written to."""
    return torch.tensor(values, dtype=dtype, device=device)


def f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def u16(packed: torch.Tensor) -> torch.Tensor:
    """[n, 2k] bytes (little-endian uint16s) -> [n, k] int32."""
    pairs = packed.reshape(packed.shape[0], -1, 2).int()
    return pairs[..., 0] | (pairs[..., 1] << 8)


def u32(packed: torch.Tensor) -> torch.Tensor:
    """[n, 4k] bytes (little-endian uint32s) -> [n, k] int64."""
    return packed.contiguous().view(torch.int32).long() & 0xFFFFFFFF


def nibble_pairs(packed: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] uint8: each byte's low nibble, then its high nibble."""
    n = packed.shape[0]
    return ((packed[:, :, None] >> const((0, 4), torch.uint8, packed.device)) & 15).reshape(n, -1)


@functools.cache
def _grid(name: str, device: torch.device) -> torch.Tensor:
    """gguf.quants' grid of type `name` as float32 [entries, 4 or 8] on `device`."""
    quant = getattr(gguf.quants, name)
    quant.init_grid()
    return torch.from_numpy(quant.grid.reshape(quant.grid_shape).copy()).to(device)


@functools.cache
def _signs(device: torch.device) -> torch.Tensor:
    """[256, 8] int8: row `byte` is -1 where bit k of byte is set, else +1."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return (1 - 2 * bits).to(torch.int8).to(device)


@functools.cache
def _ksigns(device: torch.device) -> torch.Tensor:
    """[128, 8] int8: the signs of IQ2_XXS.ksigns[i] (7 stored sign bits, even parity)."""
    ksigns = torch.from_numpy(np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy())
    return _signs(torch.device("cpu"))[ksigns.long()].to(device)


def _shifted7(aux: torch.Tensor) -> torch.Tensor:
    """[n, k] uint32 (int64) -> [n, k, 4] long: its four 7-bit fields (sign indices)."""
    return (aux[..., None] >> const((0, 7, 14, 21), torch.int64, aux.device)) & 127


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """f16 d, then per 32 weights a uint32 of four grid bytes and a uint32 of four 7-bit sign
    indices and a 4-bit scale: d * (0.5 + s) * 0.25 * grid * signs."""
    n = b.shape[0]
    aux = u32(b[:, 2:66]).view(n, 8, 2)[..., 1]  # [n, 8]
    db = f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.25
    signs = _ksigns(b.device)[_shifted7(aux)]  # [n, 8, 4, 8]
    grid = _grid("IQ2_XXS", b.device)[b[:, 2:66].reshape(n, 8, 2, 4)[:, :, 0].long()]
    return grid.mul_(db[..., None, None]).mul_(signs).view(n, 256)  # (db * grid) * sign


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 32 uint16s (9-bit grid index, 7-bit sign index), 16 scale nibbles."""
    n = b.shape[0]
    qs = u16(b[:, 2:66])  # [n, 32]
    db = f16(b, 0) * (0.5 + nibble_pairs(b[:, 66:74]).float()) * 0.25  # [n, 16]
    signs = _ksigns(b.device)[(qs >> 9).long()].view(n, 16, 2, 8)
    grid = _grid("IQ2_XS", b.device)[(qs & 511).long()].view(n, 16, 2, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).view(n, 256)  # (db * grid) * sign


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 32 grid-index low bytes, 32 sign bytes, 8 bytes of 2-bit index highs, 16 scale
    nibbles."""
    n = b.shape[0]
    db = f16(b, 0) * (0.5 + nibble_pairs(b[:, 74:82]).float()) * 0.25  # [n, 16]
    signs = _signs(b.device)[b[:, 34:66].long()].view(n, 16, 2, 8)
    high = (b[:, 66:74, None] >> const((0, 2, 4, 6), torch.uint8, b.device)) & 3
    index = b[:, 2:34].long() | (high.reshape(n, 32).long() << 8)
    grid = _grid("IQ2_S", b.device)[index].view(n, 16, 2, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).view(n, 256)  # (db * grid) * sign


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 64 grid bytes (4 weights each), 8 uint32s of four 7-bit sign indices and a 4-bit
    scale: d * (0.5 + s) * 0.5 * grid * signs."""
    n = b.shape[0]
    aux = u32(b[:, 66:98])  # [n, 8]
    db = f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.5
    signs = _ksigns(b.device)[_shifted7(aux)]  # [n, 8, 4, 8]
    grid = _grid("IQ3_XXS", b.device)[b[:, 2:66].long()].view(n, 8, 4, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).view(n, 256)  # (db * grid) * sign


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 64 grid-index low bytes, 8 bytes of index high bits, 32 sign bytes, 8 scale
    nibbles: d * (1 + 2 * s) * grid * signs."""
    n = b.shape[0]
    db = f16(b, 0) * (1 + 2 * nibble_pairs(b[:, 106:110])).float()  # [n, 8]
    signs = _signs(b.device)[b[:, 74:106].long()].view(n, 8, 4, 8)
    high = (b[:, 66:74, None] >> const(tuple(range(8)), torch.uint8, b.device)) & 1
    index = b[:, 2:66].long() | (high.reshape(n, 64).long() << 8)
    grid = _grid("IQ3_S", b.device)[index].view(n, 8, 4, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).view(n, 256)  # (db * grid) * sign


_DELTA = 0.125  # gguf.quants.IQ1_S.delta


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 32 grid-index low bytes, 8 uint16s (four 3-bit index highs, a 3-bit scale, the
    delta's sign): d * (2 * s + 1) * (grid +- 1/8)."""
    n = b.shape[0]
    qh = u16(b[:, 34:50])  # [n, 8]
    dl = f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()
    delta = (1 - 2 * ((qh >> 15) & 1)).float() * _DELTA
    high = (qh[..., None] >> const((0, 3, 6, 9), torch.int32, b.device)) & 7  # [n, 8, 4]
    index = b[:, 2:34].reshape(n, 8, 4).long() | (high.long() << 8)
    grid = _grid("IQ1_S", b.device)[index]  # [n, 8, 4, 8]
    return grid.add_(delta[..., None, None]).mul_(dl[..., None, None]).view(n, 256)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    """32 grid-index low bytes, 16 bytes of nibbles (3-bit index high, delta sign), four
    uint16s of four 3-bit scales with the f16 d in their top nibbles."""
    n = b.shape[0]
    sb = b[:, 48:56]
    low, high = (sb[:, 1] >> 4) | (sb[:, 3] & 0xF0), (sb[:, 5] >> 4) | (sb[:, 7] & 0xF0)
    d = torch.stack((low, high), 1).view(torch.float16).float()  # [n, 1]
    scales = (u16(sb)[..., None] >> const((0, 3, 6, 9), torch.int32, b.device)) & 7  # [n, 4, 4]
    dl = d * (2 * scales.reshape(n, 16) + 1).float()
    qh = nibble_pairs(b[:, 32:48])  # [n, 32]
    index = b[:, :32].long() | ((qh & 7).long() << 8)
    delta = (1 - 2 * ((qh >> 3) & 1).float()) * _DELTA
    grid = _grid("IQ1_M", b.device)[index].add_(delta[..., None])  # [n, 32, 8]
    return grid.view(n, 8, 2, 2, 8).mul_(dl.view(n, 8, 2, 1, 1)).view(n, 256)


IQ_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
}
