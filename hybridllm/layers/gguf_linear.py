"""Linear layers computed straight from GGUF blocks by the native op `hybridllm::gguf_linear`."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from hybridllm.layers.cpu_kernels import load_cpu_kernels

# Block formats the native op reads; other GGUF types are dequantized at load time.
GGUF_KERNEL_TYPES: frozenset[int] = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
)


def gguf_kernel_types(device: torch.device, tp_size: int) -> frozenset[int]:
    """The GGUF types a worker keeps quantized: CPU workers with unsharded weights.

    Any activation dtype: the op computes in fp32 (a bf16 CPU stage of a GPU+CPU run reads
    its layers' 4-bit blocks, as llama.cpp's partial offload does).
    """
    if device.type != "cpu" or tp_size != 1:
        return frozenset()
    return GGUF_KERNEL_TYPES if load_cpu_kernels() else frozenset()


def gguf_linear(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, out_features: int
) -> torch.Tensor:
    """`x @ W.T` for `x` [..., in] and `qweight` [out, in / 32 * block_bytes] uint8; the
    result has x's dtype (the op computes in fp32)."""
    lead = x.shape[:-1]
    out = torch.ops.hybridllm.gguf_linear(
        x.reshape(-1, x.shape[-1]).float(), qweight, ggml_type, out_features
    )
    return out.view(*lead, out_features).to(x.dtype)
