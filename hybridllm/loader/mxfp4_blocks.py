"""MXFP4 checkpoints (gpt-oss): weights stored as `X_blocks` + `X_scales` tensors, read as GGUF
MXFP4 blocks without ever making floats.

Such a folder's config.json says `"quantization_config": {"quant_method": "mxfp4", ...}` and its
MoE experts are stored as
    X_blocks  uint8 [..., rows, cols / 32, 16]: each 32-weight block's 4-bit E2M1 codes, weight
              2k in the low nibble of byte k, weight 2k + 1 in the high one;
    X_scales  uint8 [..., rows, cols / 32]: each block's E8M0 exponent e, the block's weights
              being E2M1 * 2^(e - 127) (transformers' `convert_moe_packed_tensors`).
Rows are output features. GGUF's MXFP4 (GGMLQuantizationType.MXFP4, 17-byte blocks) holds the
same codes and exponent: the byte e, then 16 bytes whose byte j holds weight j (low nibble) and
weight j + 16 (high nibble); its decoding, E2M1 doubled times 2^(e - 128), is the same weight.

The loader yields one tensor `X` per pair: a `QuantizedTensor` of type MXFP4 with shape
[prod(...) * rows, cols] (a stack of experts as its rows, as a GGUF expert stack is) where the
worker computes MXFP4 natively (`quantized_types`), else the float32 decoding [..., rows, cols].
gpt-oss's `mlp.experts.gate_up_proj` rows interleave gate and up (row 2j gate j, row 2j + 1 up
j): `deinterleave_rows` puts each expert's gate rows first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType

from hybridllm.loader.model_source import ModelLoadError

if TYPE_CHECKING:  # imported where used: it imports torch, which reading a folder's names needs not
    from hybridllm.loader.quantized_tensor import QuantizedTensor

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
MXFP4 = GGMLQuantizationType.MXFP4
GGUF_BLOCK_BYTES = 17  # the E8M0 byte, then 16 bytes of nibbles
# Blocks repacked at a time: the temporaries (nibble planes) stay a few MiB.
_CHUNK_BLOCKS = 1 << 18


def is_mxfp4_quant(hf_config: Any) -> bool:
    """Whether config.json's quantization_config is MXFP4 (gpt-oss's)."""
    qc = getattr(hf_config, "quantization_config", None)
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"


def mxfp4_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """X -> (X_blocks, X_scales) for every X whose two tensors are both stored."""
    present = set(names)
    pairs = {}
    for name in present:
        if name.endswith(BLOCKS_SUFFIX):
            base = name[: -len(BLOCKS_SUFFIX)]
            if base + SCALES_SUFFIX in present:
                pairs[base] = (name, base + SCALES_SUFFIX)
    return pairs


def repack_mxfp4(name: str, blocks: np.ndarray, scales: np.ndarray) -> QuantizedTensor:
    """HF's `blocks` [..., rows, G, 16] + `scales` [..., rows, G] (uint8) as GGUF MXFP4 blocks
    [prod(...) * rows, G * 17]: byte moves only. `name` is the weight's, for errors."""
    from hybridllm.loader.quantized_tensor import QuantizedTensor

    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if (
        blocks.dtype != np.uint8
        or scales.dtype != np.uint8
        or blocks.ndim < 3
        or blocks.shape[-1] != 16
        or blocks.shape[:-1] != scales.shape
    ):
        raise ModelLoadError(
            f"{name}: MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales "
            f"{scales.dtype} {list(scales.shape)} are not uint8 [..., rows, G, 16] and "
            "[..., rows, G]"
        )
    groups = blocks.shape[-2]
    rows = math.prod(blocks.shape[:-2])
    src = blocks.reshape(rows * groups, 16)
    exps = scales.reshape(rows * groups)
    out = np.empty((rows * groups, GGUF_BLOCK_BYTES), dtype=np.uint8)
    for start in range(0, rows * groups, _CHUNK_BLOCKS):
        end = min(rows * groups, start + _CHUNK_BLOCKS)
        chunk = src[start:end]
        low, high = chunk & 0x0F, chunk >> 4  # weights 2k, 2k + 1 of byte k
        # weights 0-15 from bytes 0-7, 16-31 from bytes 8-15, each as (2k, 2k + 1) pairs
        first = np.stack((low[:, :8], high[:, :8]), axis=-1).reshape(-1, 16)
        second = np.stack((low[:, 8:], high[:, 8:]), axis=-1).reshape(-1, 16)
        out[start:end, 0] = exps[start:end]
        np.bitwise_or(first, second << 4, out=out[start:end, 1:])
    return QuantizedTensor(out.reshape(rows, groups * GGUF_BLOCK_BYTES), MXFP4, (rows, groups * 32))


def mxfp4_weight(name: str, blocks: Any, scales: Any, keep_blocks: bool) -> QuantizedTensor | Any:
    """The weight `name` of a blocks / scales pair (torch or numpy uint8): its MXFP4 blocks as
    a QuantizedTensor where the worker computes them (`keep_blocks`), else float32
    [..., rows, cols] decoded from them."""
    import torch

    def as_numpy(t: Any) -> np.ndarray:
        return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)

    blocks_np, scales_np = as_numpy(blocks), as_numpy(scales)
    qt = repack_mxfp4(name, blocks_np, scales_np)
    if keep_blocks:
        return qt
    shape = (*blocks_np.shape[:-2], blocks_np.shape[-2] * 32)
    return qt.dequantize().reshape(shape)


def deinterleave_rows(qt: QuantizedTensor, num_experts: int) -> QuantizedTensor:
    """gpt-oss's gate_up [E * 2I, H] rows (each expert's rows gate 0, up 0, gate 1, ...)
    reordered to each expert's gate rows, then its up rows; a copy (whole rows of blocks move,
    nothing is decoded)."""
    from hybridllm.loader.quantized_tensor import QuantizedTensor

    rows = qt.shape[0]
    if num_experts <= 0 or rows % (2 * num_experts):
        raise ValueError(f"{rows} rows are not {num_experts} experts of gate/up row pairs")
    per_expert = rows // num_experts
    local = np.concatenate((np.arange(0, per_expert, 2), np.arange(1, per_expert, 2)))
    order = (np.arange(num_experts)[:, None] * per_expert + local).reshape(-1)
    return QuantizedTensor(np.take(qt.raw, order, axis=0), qt.ggml_type, qt.shape)
