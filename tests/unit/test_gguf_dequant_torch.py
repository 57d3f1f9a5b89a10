"""The torch GGUF decoders (what an accelerator runs on streamed blocks) equal gguf's numpy ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from hybridllm.layers.gguf_dequant_torch import TORCH_DECODED_TYPES, dequantize_torch
from tests.gguf_helpers import random_k_quant_blocks


def _random_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random blocks of `qtype` [rows, bytes_per_row] with finite float16 scales."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_k_quant_blocks((rows, cols), qtype)
    values = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    return quantize(values, qtype)


@pytest.mark.parametrize("qtype", sorted(TORCH_DECODED_TYPES))
def test_torch_decode_equals_gguf(qtype):
    qtype = Q(qtype)
    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols)
    want = gguf_dequantize(raw, qtype).reshape(rows, cols)
    got = dequantize_torch(torch.from_numpy(np.ascontiguousarray(raw)), qtype, rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy(), want.astype(np.float32))


def test_unknown_types_are_refused():
    with pytest.raises(ValueError, match="Q5_0"):
        dequantize_torch(torch.zeros(1, 22, dtype=torch.uint8), Q.Q5_0, 1, 32)
