"""Linear layers computed straight from GGUF blocks by the native op `hybridllm::gguf_linear`."""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.loader.model_source import ModelSource
from hybridllm.plan.model_size import GGUFBlockSizes

# Block formats the native op reads; other GGUF types are dequantized at load time.
GGUF_KERNEL_TYPES: frozenset[int] = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


# GGUF tensors stacked into one Linear: kept as blocks when the op reads each one's type.
_STACKED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def gguf_block_sizes(source: ModelSource, num_layers: int) -> GGUFBlockSizes | None:
    """What a CPU worker keeps of `source` as GGUF blocks (all layers, unsharded), for the budgets
    and cost model; None for other formats, without the native op, or an unknown layout."""
    tensor_infos = getattr(source, "tensor_infos", None)
    if tensor_infos is None or not load_cpu_kernels():
        return None
    infos = tensor_infos()
    kept_params = kept_bytes = total_params = 0
    for layer in range(num_layers):
        for stack in _STACKED:
            members = [infos.get(f"blk.{layer}.{name}.weight") for name in stack]
            if any(m is None for m in members):
                return None
            kept = all(m.ggml_type in GGUF_KERNEL_TYPES for m in members)
            for m in members:
                total_params += math.prod(m.shape)
                if kept:
                    kept_params += math.prod(m.shape)
                    kept_bytes += m.nbytes

    def kept_nbytes(name: str) -> int | None:
        info = infos.get(name)
        return info.nbytes if info is not None and info.ggml_type in GGUF_KERNEL_TYPES else None

    embedding = kept_nbytes("token_embd.weight")
    head = kept_nbytes("output.weight") if "output.weight" in infos else embedding
    return GGUFBlockSizes(kept_params, kept_bytes, total_params, head, embedding)


def gguf_kernel_types(device: torch.device) -> frozenset[int]:
    """The GGUF types a worker keeps quantized: CPU workers (tensor-parallel ones their slices).

    Any activation dtype: the op computes in fp32 (a bf16 CPU stage of a GPU+CPU run reads
    its layers' 4-bit blocks, as llama.cpp's partial offload does).
    """
    if device.type != "cpu":
        return frozenset()
    return GGUF_KERNEL_TYPES if load_cpu_kernels() else frozenset()


# GGML's type id of plain fp32 tensors: the op reads an fp32 weight's own bytes as 32-float blocks.
GGML_F32 = int(GGMLQuantizationType.F32)


def own_f32_gemm_preferred() -> bool:
    """Whether CPU workers should compute fp32 linears with the native op instead of F.linear.

    Torch's BLAS on x86 is MKL, which runs AVX-512 sgemm kernels on Intel CPUs only; elsewhere
    (AMD EPYC here) it ran at half the op's rate from decode to prefill shapes.
    """
    return load_cpu_kernels() and not torch.ops.hybridllm.blas_has_avx512_kernels()


def gguf_linear(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, out_features: int
) -> torch.Tensor:
    """`x @ W.T` for `x` [..., in] and `qweight` [out, in / 32 * block_bytes] uint8; the
    result has x's dtype (the op computes in fp32)."""
    if x.dim() == 2 and x.dtype == torch.float32:  # the common case: no reshapes or casts
        return torch.ops.hybridllm.gguf_linear(x, qweight, ggml_type, out_features)
    lead = x.shape[:-1]
    out = torch.ops.hybridllm.gguf_linear(
        x.reshape(-1, x.shape[-1]).float(), qweight, ggml_type, out_features
    )
    return out.view(*lead, out_features).to(x.dtype)
