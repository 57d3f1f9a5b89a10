"""GGUF tensor decoding to torch: vectorised numpy for the common block formats, gguf's otherwise.

The hand-written kernels compute exactly what `gguf.quants.dequantize` (and llama.cpp) compute,
`d * q (+ m)` in float32, so results are bit-identical; they are 3-4x faster because they write
each output once instead of building intermediate arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType


def _scales(blocks: np.ndarray, count: int) -> np.ndarray:
    # The leading `count` float16 scales of each block: [num_blocks, count] float32.
    return blocks[:, : 2 * count].copy().view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 d, 32 x int8 q; x = d * q.  blocks: [num_blocks, 34]
    d = _scales(blocks, 1)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)  # [num_blocks, 32]
    out *= d
    return out


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    # 16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31.
    out = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.float32)
    half = packed.shape[1]
    np.bitwise_and(packed, 15, out=out[:, :half], casting="unsafe")
    np.right_shift(packed, 4, out=out[:, half:], casting="unsafe")
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 d, 16 bytes of nibbles; x = d * (q - 8).  blocks: [num_blocks, 18]
    d = _scales(blocks, 1)
    out = _unpack_nibbles(blocks[:, 2:])
    out -= 8
    out *= d
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.  blocks: [num_blocks, 20]
    dm = _scales(blocks, 2)
    out = _unpack_nibbles(blocks[:, 4:])
    out *= dm[:, 0:1]
    out += dm[:, 1:2]
    return out


_BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
}
# Formats torch holds natively: kept in their own precision, no conversion.
_NATIVE_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def decoded_dtype(ggml_type: GGMLQuantizationType) -> torch.dtype:
    """The dtype `dequantize` returns for a ggml type: its own if torch has it, else float32."""
    return _NATIVE_DTYPES.get(ggml_type, torch.float32)


def dequantize(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode raw GGUF bytes `[rows, bytes_per_row]` into a new tensor of torch `shape`."""
    native = _NATIVE_DTYPES.get(ggml_type)
    if native is not None:
        # Copy out of the read-only mmap; uint8 -> target dtype is a reinterpretation.
        return torch.from_numpy(raw.copy()).view(native).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    kernel = _BLOCK_KERNELS.get(ggml_type)
    raw = raw.reshape(-1, raw.shape[-1]) if raw.ndim else raw.reshape(1, -1)
    row_values = raw.shape[1] // type_size * block_size
    out = np.empty((raw.shape[0], row_values), dtype=np.float32)
    # Rows a chunk at a time: the decoders' temporaries stay a chunk's size, not the tensor's
    # (a vocabulary's table decoded whole held twice its floats at once).
    step = max(1, _CHUNK_VALUES // max(1, row_values))
    for start in range(0, raw.shape[0], step):
        chunk = raw[start : start + step]
        if kernel is None:
            values = gguf_dequantize(chunk, ggml_type)  # K-quants, IQ formats: gguf's numpy code
        else:
            values = kernel(chunk.reshape(-1, type_size))
        out[start : start + step] = values.reshape(len(chunk), row_values)
    return torch.from_numpy(out).reshape(shape)


# Values decoded per chunk by `dequantize` (16 MiB of float32).
_CHUNK_VALUES = 1 << 22
