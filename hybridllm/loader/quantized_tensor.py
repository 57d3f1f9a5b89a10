"""A GGUF weight kept in its quantized blocks, for layers with a kernel that reads them directly."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridllm.loader.gguf_dequant import dequantize


@dataclass(frozen=True)
class QuantizedTensor:
    """`raw` holds the blocks of a 2-D weight, one row of blocks per output row.

    `raw`: uint8 [rows, bytes_per_row], possibly a read-only view of a memory-mapped file
    (copy it with `blocks()` before keeping it); `shape`: the dequantized [rows, cols].
    """

    raw: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    def blocks(self) -> torch.Tensor:
        """A copy of the blocks as a uint8 tensor [rows, bytes_per_row]."""
        return torch.from_numpy(self.copy().raw)

    def copy(self) -> QuantizedTensor:
        """The same blocks in memory of their own (contiguous), no longer a view of a file."""
        raw = np.array(self.raw, dtype=np.uint8, copy=True, order="C")
        return QuantizedTensor(raw, self.ggml_type, self.shape)

    def rows(self, start: int, end: int) -> QuantizedTensor:
        """Output rows [start, end): a view, since every row is its own run of blocks."""
        return QuantizedTensor(self.raw[start:end], self.ggml_type, (end - start, self.shape[1]))

    def columns(self, start: int, end: int) -> QuantizedTensor | None:
        """Input columns [start, end), a view, when both ends fall on block boundaries; else
        None (a block's 32 weights share one scale and cannot be split)."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        if start % block or end % block:
            return None
        raw = self.raw[:, start // block * type_size : end // block * type_size]
        return QuantizedTensor(raw, self.ggml_type, (self.shape[0], end - start))

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor [rows, cols] these blocks encode."""
        return dequantize(self.raw, self.ggml_type, self.shape)
