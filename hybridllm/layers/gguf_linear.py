"""Linear layers computed straight from GGUF blocks by the native op `hybridllm::gguf_linear`."""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

from hybridllm import envs
from hybridllm.layers.cpu_kernels import cpu_kernels_enabled, load_cpu_kernels
from hybridllm.loader.gguf_kernel_types import GGUF_KERNEL_TYPES


def gguf_kernel_types(device: torch.device, cpu_kernels: bool) -> frozenset[int]:
    """The GGUF types a worker keeps quantized: CPU workers (tensor-parallel ones their slices)
    that compute with the native kernels (`cpu_kernels`: the engine's setting; they must also
    be built here).

    Any activation dtype: the op computes in fp32 (a bf16 CPU stage of a GPU+CPU run reads
    its layers' 4-bit blocks, as llama.cpp's partial offload does).
    """
    if device.type != "cpu" or not cpu_kernels_enabled(cpu_kernels):
        return frozenset()
    return GGUF_KERNEL_TYPES


# GGML's type id of plain fp32 tensors: the op reads an fp32 weight's own bytes as 32-float blocks.
GGML_F32 = int(GGMLQuantizationType.F32)


def own_f32_gemm_preferred() -> bool:
    """Whether CPU workers should compute fp32 linears with the native op instead of F.linear.

    Torch's BLAS on x86 is MKL, which runs AVX-512 sgemm kernels on Intel CPUs only; elsewhere
    (AMD EPYC here) it ran at half the op's rate from decode to prefill shapes.
    """
    return load_cpu_kernels() and not torch.ops.hybridllm.blas_has_avx512_kernels()


# The op's `activations` argument. FP32: fp32 activations and arithmetic, exact up to fp32
# rounding against the dequantized weights (what the correctness tests pin). INT8: the rows of x
# are quantized to int8, 32 values a scale (256 for K-quants), for integer dot products (few rows:
# decode kernels; 8 rows or more, 13-16 for weights in x8 groups: an int8 GEMM where the CPU has
# AVX512-VNNI, else fp32 above 24 rows). Plain fp32 weights (F32) always stay fp32.
FP32_ACTIVATIONS, INT8_ACTIVATIONS = 0, 1
# The op's code of each `KernelConfig.gguf_activations` setting.
ACTIVATIONS = {"fp32": FP32_ACTIVATIONS, "int8": INT8_ACTIVATIONS}
# "int8" (the default: faster decode, see docs/benchmarks.md) or "fp32".
ACTIVATIONS_ENV = envs.GGUF_ACTIVATIONS.name


@functools.cache  # read once: modules built outside an engine take it at construction
def default_activations() -> int:
    """The `activations` of layers built outside an engine and of the wrapper's direct callers:
    INT8 unless HYBRIDLLM_GGUF_ACTIVATIONS=fp32. An engine's models take the engine config's
    (`CausalLMBase.process_weights_after_loading`)."""
    return ACTIVATIONS[envs.read(envs.GGUF_ACTIVATIONS)]


# Not GGML types: Q4_K / Q5_K / Q6_K / Q2_K / Q3_K / IQ4_XS / IQ2_XXS / IQ3_XXS / Q4_0 / Q4_1 /
# Q8_0 / IQ4_NL rows repacked in groups of 8 for the int8 kernels (csrc/gguf_x8.h), which read
# them faster from DRAM at one row of x than the types' own layouts (Q4_K 15-20%, a 1B's Q6_K down
# projections ~12%, Q4_0 / Q8_0 16384 x 8192 0.66-0.87x / 0.82x the time, IQ4_XS on AVX2 0.73x,
# IQ2_XXS 0.59x) and compute few rows of x (a speculative verify step's) in 0.35-0.64x the time.
# IQ2_XXS's and IQ3_XXS's layouts keep their signs as bit planes (70 and 102 bytes a row's
# super-block against 66 and 98).
GGML_Q4_K_X8, GGML_Q5_K_X8, GGML_Q6_K_X8, GGML_Q2_K_X8, GGML_Q3_K_X8 = 112, 113, 114, 115, 116
GGML_Q4_0_X8, GGML_Q4_1_X8, GGML_Q8_0_X8, GGML_IQ4_NL_X8, GGML_IQ4_XS_X8 = 117, 118, 119, 120, 121
GGML_IQ2_XXS_X8, GGML_IQ3_XXS_X8 = 122, 123
X8_TYPES = {
    int(GGMLQuantizationType.Q4_K): GGML_Q4_K_X8,
    int(GGMLQuantizationType.Q5_K): GGML_Q5_K_X8,
    int(GGMLQuantizationType.Q6_K): GGML_Q6_K_X8,
    int(GGMLQuantizationType.Q2_K): GGML_Q2_K_X8,
    int(GGMLQuantizationType.Q3_K): GGML_Q3_K_X8,
    int(GGMLQuantizationType.Q4_0): GGML_Q4_0_X8,
    int(GGMLQuantizationType.Q4_1): GGML_Q4_1_X8,
    int(GGMLQuantizationType.Q8_0): GGML_Q8_0_X8,
    int(GGMLQuantizationType.IQ4_NL): GGML_IQ4_NL_X8,
    int(GGMLQuantizationType.IQ4_XS): GGML_IQ4_XS_X8,
    int(GGMLQuantizationType.IQ2_XXS): GGML_IQ2_XXS_X8,
    int(GGMLQuantizationType.IQ3_XXS): GGML_IQ3_XXS_X8,
}
X8_SOURCE_TYPES = {x8: source for source, x8 in X8_TYPES.items()}


def x8_source_types() -> list[int]:
    """The ggml types this build computes in x8 groups: every type of X8_TYPES but IQ4_XS,
    IQ2_XXS and IQ3_XXS where the CPU has AVX512-VNNI, all of them on AVX2 alone, none else.
    Call only where the native kernels are loaded."""
    return torch.ops.hybridllm.x8_source_types()


def x8_repacking(activations: int) -> bool:
    """Whether a CPU worker computing with `activations` repacks block weights into x8 groups
    when it loads (those of `x8_source_types()`): int8 activations and a build with x8 kernels.
    Call only where the native kernels are loaded."""
    return activations == INT8_ACTIVATIONS and bool(x8_source_types())


def repack_x8(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """Blocks of an x8 source type [..., rows, bytes] (rows % 8 == 0) -> (x8 blocks, x8 type)."""
    return torch.ops.hybridllm.repack_x8(blocks.contiguous(), ggml_type), X8_TYPES[ggml_type]


def repack_x8_where_grouped(
    blocks: torch.Tensor, ggml_type: int, rows: int
) -> tuple[torch.Tensor, int]:
    """`repack_x8` where this build computes `ggml_type` in x8 groups (`x8_source_types`) and a
    matrix's `rows` are whole groups of 8; else (blocks, ggml_type) unchanged."""
    if rows % 8 == 0 and ggml_type in x8_source_types():
        return repack_x8(blocks, ggml_type)
    return blocks, ggml_type


def unpack_x8(blocks: torch.Tensor, x8_type: int) -> tuple[torch.Tensor, int]:
    """The inverse of `repack_x8`: (the source blocks, byte for byte, their type)."""
    source = X8_SOURCE_TYPES[x8_type]
    return torch.ops.hybridllm.unpack_x8(blocks.contiguous(), source), source


def gguf_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    ggml_type: int,
    out_features: int,
    activations: int | None = None,
) -> torch.Tensor:
    """`x @ W.T` for `x` [..., in] and `qweight` [out, in / 32 * block_bytes] uint8; the
    result has x's dtype (the op computes in fp32, or int8 x integer weights: `activations`;
    the layers pass their own, direct callers get `default_activations()`)."""
    if activations is None:
        activations = default_activations()
    if x.dim() == 2 and x.dtype == torch.float32:  # the common case: no reshapes or casts
        return torch.ops.hybridllm.gguf_linear(x, qweight, ggml_type, out_features, activations)
    lead = x.shape[:-1]
    out = torch.ops.hybridllm.gguf_linear(
        x.reshape(-1, x.shape[-1]).float(), qweight, ggml_type, out_features, activations
    )
    return out.view(*lead, out_features).to(x.dtype)
