"""What `dtype="auto"` computes in on CPU workers (a bf16 checkpoint's own bf16 where this CPU
has bf16 dot products and its measured bf16 GEMM beats fp32, else fp32), and what
`kv_cache_dtype="auto"` stores there."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# /proc/cpuinfo flags of native bf16 dot products (vdpbf16ps; AMX tiles)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype config.json records for the weights ("dtype", "torch_dtype" before
    transformers 4.56), as a torch dtype name; None when it records none."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if value is None else str(value).removeprefix("torch.")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux); empty where /proc/cpuinfo is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_auto_dtype(
    checkpoint: str | None,
    float_weights: bool,
    flags: Iterable[str],
    gemm_rates: Callable[[], tuple[float, float]],
) -> str:
    """The dtype ("bfloat16" or "float32") of a CPU-only run of a checkpoint stored as
    `checkpoint`.

    `float_weights`: the linears hold float weights (not GGUF blocks, which compute from fp32
    activations). `gemm_rates`: () -> (fp32, bf16) FLOP/s of this CPU's batch-64 GEMM, asked
    only when the rest allows bf16 (the hardware profile, measured once per machine). On a
    2-core AMD EPYC (AVX512-BF16) a bf16 1B-shaped checkpoint ran 1.6x the fp32 decode rate and
    2.5x its prefill in bf16; on machine A's Xeon bf16 GEMMs ran 3.7x slower than fp32.
    """
    if checkpoint != "bfloat16" or not float_weights or not BF16_FLAGS & set(flags):
        return "float32"
    fp32, bf16 = gemm_rates()
    return "bfloat16" if bf16 > fp32 else "float32"


def auto_dtype_for(
    hf_config: Any,
    quantization: str,
    cpu_blocks: object | None,
    gemm_rates: Callable[[], tuple[float, float]],
) -> str:
    """`cpu_auto_dtype` for a model as the engine loads it: float weights unless a CPU worker
    keeps GGUF blocks (`cpu_blocks`) or `quantization` quantizes them at load."""
    float_weights = cpu_blocks is None and quantization in ("auto", "none")
    return cpu_auto_dtype(checkpoint_dtype(hf_config), float_weights, cpu_flags(), gemm_rates)


def cpu_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: str, int8_blocks: bool) -> str:
    """What a CPU worker's KV cache holds: `kv_cache_dtype`, where "auto" is float16 when the
    worker computes fp32 from GGUF blocks with int8 activations (`int8_blocks`: llama.cpp's
    arrangement, an f16 cache beside approximate dot products; half the bytes decode reads,
    logprobs within ~3e-3 on the embedded model), else the compute dtype (the exact paths)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float16" if compute_dtype == "float32" and int8_blocks else compute_dtype


def cpu_kernels_built(asked: bool) -> bool:
    """Whether CPU workers compute with the native kernels: asked for (`--cpu-kernels`) and built
    on this machine. The plan counts GGUF blocks only where the kernels read them, so config
    building runs the build (once per machine, cached) before it places the model."""
    from hybridllm.layers.cpu_kernels import cpu_kernels_enabled  # deferred: torch, the build

    return cpu_kernels_enabled(asked)
