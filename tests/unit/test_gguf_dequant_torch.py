"""The torch GGUF decoders (what an accelerator runs on streamed blocks) equal gguf's numpy ones
bit for bit, for every block type they decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from hybridllm.layers.gguf_dequant_torch import TORCH_DECODED_TYPES, dequantize_torch

# Byte offsets of each type's float16 scale fields within a block (IQ1_M: see _random_blocks).
_F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,), Q.IQ1_M: (), Q.MXFP4: (),
}  # fmt: skip
NEW_TYPES = {
    Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.Q2_K, Q.Q3_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S,
    Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.MXFP4,
}  # fmt: skip


def _random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype` [rows, bytes_per_row]: random bytes, each float16 scale field
    replaced by a small normal half of either sign (MXFP4: E8M0 exponents 2^-20 .. 2^20)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    halves = lambda: (  # noqa: E731
        rng.uniform(1e-4, 1e-2, len(raw)) * rng.choice((-1, 1), len(raw))
    ).astype(np.float16)
    for start in _F16_FIELDS[qtype]:
        raw[:, start : start + 2] = halves().view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:  # d's four nibbles are the top nibbles of the last four uint16s
        bits = halves().view(np.uint16).astype(np.uint16)
        scales = raw[:, 48:56].copy().view(np.uint16)  # [n, 4]
        for i in range(4):
            nibble = (bits >> np.uint16(4 * i)) & np.uint16(15)
            scales[:, i] = (scales[:, i] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
        raw[:, 48:56] = scales.view(np.uint8)
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(107, 148, len(raw), dtype=np.uint8)
    return raw.reshape(rows, -1)


def _quantizable(qtype: Q) -> bool:
    try:
        quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _check(raw: np.ndarray, qtype: Q, rows: int, cols: int, blocks: torch.Tensor) -> None:
    want = gguf_dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    assert np.isfinite(want).all()
    got = dequantize_torch(blocks, qtype, rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got.cpu().view(torch.int32), torch.from_numpy(want).view(torch.int32))


def test_every_new_type_is_decoded():
    assert {int(t) for t in NEW_TYPES} <= TORCH_DECODED_TYPES
    assert set(_F16_FIELDS) == {Q(t) for t in TORCH_DECODED_TYPES}


@pytest.mark.parametrize("qtype", sorted(Q(t) for t in TORCH_DECODED_TYPES), ids=lambda q: q.name)
def test_random_blocks_equal_gguf(qtype):
    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols)
    _check(raw, qtype, rows, cols, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M], ids=str)
def test_decoding_leaves_the_cached_grids_unchanged(qtype):
    """The grid decoders scale their gathered rows in place: a second decode of other blocks
    still sees gguf's grids."""
    rows, cols = 2, 256
    for seed in (7, 8):
        raw = _random_blocks(qtype, rows, cols, seed=seed)
        _check(raw, qtype, rows, cols, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize(
    "qtype", [Q(t) for t in sorted(TORCH_DECODED_TYPES) if _quantizable(Q(t))], ids=lambda q: q.name
)
def test_quantized_blocks_equal_gguf(qtype):
    rows, cols = 6, 512
    values = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(values, qtype)
    _check(raw, qtype, rows, cols, torch.from_numpy(np.ascontiguousarray(raw)))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q3_K, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ1_M], ids=str)
def test_blocks_at_an_odd_offset_of_a_byte_run(qtype):
    """The weight streamer hands the decoder a view into a slot's raw bytes, not a fresh
    tensor: offsets need not align to the type's 2- or 4-byte fields."""
    rows, cols = 3, 256
    raw = _random_blocks(qtype, rows, cols, seed=3)
    run = torch.zeros(raw.size + 16, dtype=torch.uint8)
    run[6 : 6 + raw.size] = torch.from_numpy(raw.copy()).flatten()
    _check(raw, qtype, rows, cols, run[6 : 6 + raw.size].view(rows, -1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", sorted(Q(t) for t in TORCH_DECODED_TYPES), ids=lambda q: q.name)
def test_cuda_decode_equals_gguf(qtype):
    rows, cols = 16, 1024
    raw = _random_blocks(qtype, rows, cols, seed=5)
    _check(raw, qtype, rows, cols, torch.from_numpy(raw.copy()).cuda())


def test_mxfp4_every_exponent_equals_gguf():
    """E8M0 bytes 0 .. 252, the subnormal halves (0, 1) included: as gguf decodes them, and as
    the native kernels do (tests/unit/test_gguf_block32_kernels.py checks those against gguf).
    From 253 the largest codes overflow to inf in both; those are left to the kernels' test."""
    raw = _random_blocks(Q.MXFP4, 253, 32, seed=4)
    raw[:, 0] = np.arange(253, dtype=np.uint8)
    _check(raw, Q.MXFP4, 253, 32, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.MXFP4], ids=str)
def test_blocks_of_an_odd_size_at_an_odd_offset(qtype):
    rows, cols = 3, 96
    raw = _random_blocks(qtype, rows, cols, seed=6)
    run = torch.zeros(raw.size + 16, dtype=torch.uint8)
    run[5 : 5 + raw.size] = torch.from_numpy(raw.copy()).flatten()
    _check(raw, qtype, rows, cols, run[5 : 5 + raw.size].view(rows, -1))


def test_unknown_types_are_refused():
    with pytest.raises(ValueError, match="TQ2_0"):
        dequantize_torch(torch.zeros(1, 66, dtype=torch.uint8), Q.TQ2_0, 1, 256)
