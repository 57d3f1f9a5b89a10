"""DeepSeek's block-scaled FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2, GLM-4.5-FP8, Qwen3-FP8).

Such a folder's config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`; most linear weights `X.weight`
[out, in] are stored as float8_e4m3fn beside `X.weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)], and the real weight is `weight.float() * scale_inv`, each
scale covering one 128 x 128 block (the last row and column of blocks may be partial). Norms,
embeddings, routers and the LM head stay bf16.

The loader yields each such weight dequantized to float32 under its `.weight` name (the scales
never appear as weights). CPU workers then re-block them into a GGUF type the native kernels
compute (Q8_0 unless `--quantization` names another: `onload_quantization`); GPU workers cast
them to the model dtype. FP8 matmuls on GPUs that have them (keeping the fp8 bytes and scales)
are later work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridllm.loader.model_source import ModelLoadError

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
# The --quantization an fp8 folder loads under when the user gave none: Q8_0 keeps the fp8
# values to within 1/254 of each 32-value block's largest (e4m3 has 4 significant bits).
FP8_DEFAULT_QUANTIZATION = "q8_0"
# Values dequantized at a time: the expanded scales and the float copy of the fp8 rows are
# this large (16 MiB each in fp32), beside the one output tensor.
_CHUNK_VALUES = 1 << 22
_SUPPORTED = "quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic' and weight_block_size"


@dataclass(frozen=True)
class Fp8BlockQuant:
    """A folder's block-scaled FP8 layout: the rows and columns one scale covers."""

    block: tuple[int, int]

    def describe(self) -> str:
        return f"block-scaled FP8 (e4m3, {self.block[0]}x{self.block[1]} blocks)"


def fp8_block_quant(hf_config: Any, origin: str) -> Fp8BlockQuant | None:
    """The FP8 layout config.json's `quantization_config` describes; None without one.

    Any other quantization (another quant_method, fp8 without block scales, static activation
    scales, e5m2) raises ModelLoadError naming what is unsupported: those checkpoints store
    tensors the models cannot load as weights.
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{origin}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's: its blocks load as GGUF MXFP4 (loader/mxfp4_blocks.py)
        return None
    if method != "fp8":
        raise ModelLoadError(
            f"{origin}: quantization_config quant_method {method!r} is not supported (supported: "
            f"{_SUPPORTED}, DeepSeek's block-scaled layout; 'mxfp4', gpt-oss's; or an "
            "unquantized checkpoint)"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(
            f"{origin}: fp8 fmt {fmt!r} is not supported (supported: {_SUPPORTED})"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelLoadError(
            f"{origin}: fp8 activation_scheme {scheme!r} (stored activation scales) is not "
            f"supported (supported: {_SUPPORTED})"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelLoadError(
            f"{origin}: fp8 without weight_block_size (per-tensor or per-channel scales) is not "
            f"supported (supported: {_SUPPORTED})"
        )
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelLoadError(
            f"{origin}: fp8 weight_block_size {block!r} is not a pair of positive integers"
        )
    return Fp8BlockQuant((block[0], block[1]))


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def onload_quantization(quantization: str, source: Any) -> str:
    """The `--quantization` a checkpoint loads under: "auto" on a block-scaled FP8 folder is
    Q8_0 (CPU workers re-block its linears; GPU workers dequantize them); an explicit value,
    "none" included, stays as given."""
    if quantization == "auto" and getattr(source, "fp8_block", None) is not None:
        return FP8_DEFAULT_QUANTIZATION
    return quantization


def is_fp8(tensor: torch.Tensor) -> bool:
    import torch

    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8_block(
    name: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]
) -> torch.Tensor:
    """`weight.float() * scale_inv` over the blocks, as float32 [out, in], a few rows of blocks
    at a time (the scales are expanded a chunk at a time, never over the whole tensor).

    `name` is the weight's; a missing, mis-shaped or non-float scale raises ModelLoadError
    naming the tensor."""
    import torch

    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(
            f"{name}: stored as {weight.dtype}, but the checkpoint's fp8 format is e4m3 "
            "(float8_e4m3fn)"
        )
    if weight.dim() != 2:
        raise ModelLoadError(
            f"{name}: a block-scaled fp8 weight must be 2-D [out, in], got shape "
            f"{list(weight.shape)}"
        )
    if scale is None:
        raise ModelLoadError(f"{name}: float8 weight without its scale tensor {scale_name(name)!r}")
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale.shape) != expected or not scale.is_floating_point() or is_fp8(scale):
        raise ModelLoadError(
            f"{scale_name(name)}: {scale.dtype} {list(scale.shape)} does not scale {name} "
            f"{list(weight.shape)} in {block_rows}x{block_cols} blocks (expected a float "
            f"tensor of shape {list(expected)})"
        )
    scale = scale.float()
    out = torch.empty(rows, cols, dtype=torch.float32)
    # whole rows of blocks per chunk, so each chunk starts on a block boundary
    step = max(1, _CHUNK_VALUES // max(1, cols * block_rows)) * block_rows
    for start in range(0, rows, step):
        end = min(rows, start + step)
        scales = scale[start // block_rows : math.ceil(end / block_rows)]
        scales = scales.repeat_interleave(block_rows, 0)[: end - start]
        scales = scales.repeat_interleave(block_cols, 1)[:, :cols]
        torch.mul(weight[start:end].float(), scales, out=out[start:end])
    return out
