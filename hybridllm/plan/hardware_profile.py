"""Measured device rates (bandwidth, matmul, host-to-device copy), measured once per machine and cached.

The cache is a JSON file in `$HYBRIDLLM_CACHE_DIR` (default ~/.cache/hybridllm) named by a hash
of what the numbers depend on: CPU model, core counts, GPU names and the torch version.
Simulated GPUs (`--fake-gpu`) are never measured: they get nominal spec-sheet numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm import envs
from hybridllm.platforms.discovery import GpuInfo, HardwareInfo

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = envs.CACHE_DIR.name
# 2: the fp32 rate is that of the GEMM a CPU worker runs (the native op on non-Intel CPUs)
# 3: + the rate the native op computes from Q4_1 blocks
_PROFILE_VERSION = 4
GiB = 1 << 30

# Spec-sheet peaks (dense, no sparsity): (HBM bytes/s, bf16 FLOP/s, fp32 FLOP/s, PCIe bytes/s
# one way). Matched by substring of the GPU name, most specific first.
_NOMINAL_SPECS = (
    ("h200", (4.8e12, 989e12, 67e12, 64e9)),  # H200 SXM, PCIe Gen5 x16
    ("h100 pcie", (2.0e12, 756e12, 51e12, 64e9)),
    ("h100", (3.35e12, 989e12, 67e12, 64e9)),  # H100 SXM5 80GB
    ("a100", (2.039e12, 312e12, 19.5e12, 32e9)),  # A100 SXM 80GB, PCIe Gen4 x16
    ("l40s", (0.864e12, 362e12, 91.6e12, 32e9)),
    ("l4", (0.3e12, 121e12, 30e12, 32e9)),
    ("", (1.0e12, 100e12, 20e12, 32e9)),  # anything else: a generic mid-range GPU
)
# What real code reaches of a spec-sheet peak (typical of a large sum / GEMM / pinned copy).
_BANDWIDTH_EFFICIENCY = 0.85
_MATMUL_EFFICIENCY = 0.7
_PCIE_EFFICIENCY = 0.8


@dataclass(frozen=True)
class CpuRates:
    """All-threads rates of the host CPU."""

    read_bandwidth: float  # bytes/s, streaming read of a tensor far larger than the caches
    fp32_flops: float  # FLOP/s of a batch-64 GEMM
    bf16_flops: float
    threads: int  # threads the numbers were measured with
    # bytes/s of GGUF Q4_1 blocks the native op computes from at batch 1, out of DRAM: decoding
    # the blocks, not the memory, may set the pace; None without the op
    block_read_bandwidth: float | None = None
    # FLOP/s of the same op on Q4_1 blocks at batch 64 with its default activations (the int8
    # GEMM where built): what a CPU worker's prefill and large batches compute from blocks at
    block_gemm_flops: float | None = None


@dataclass(frozen=True)
class GpuRates:
    """One GPU's rates; `nominal` marks spec-sheet numbers rather than measured ones."""

    name: str
    read_bandwidth: float  # bytes/s
    bf16_flops: float  # FLOP/s of a large GEMM
    fp32_flops: float
    h2d_bandwidth: float  # pinned host -> device copy, bytes/s
    nominal: bool = False


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of the CPU and of every GPU (by CUDA index) of one machine."""

    cpu: CpuRates
    gpus: tuple[GpuRates, ...] = ()

    def gpu(self, index: int) -> GpuRates:
        if not 0 <= index < len(self.gpus):
            raise ValueError(f"no rates for cuda:{index}; the profile has {len(self.gpus)} GPU(s)")
        return self.gpus[index]

    def to_dict(self) -> dict:
        return {
            "cpu": dataclasses.asdict(self.cpu),
            "gpus": [dataclasses.asdict(g) for g in self.gpus],
        }

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        return cls(CpuRates(**data["cpu"]), tuple(GpuRates(**g) for g in data["gpus"]))


def nominal_gpu_rates(name: str) -> GpuRates:
    """Derated spec-sheet rates for a GPU known only by name (simulated GPUs)."""
    lowered = name.lower()
    bandwidth, bf16, fp32, pcie = next(spec for key, spec in _NOMINAL_SPECS if key in lowered)
    return GpuRates(
        name=name,
        read_bandwidth=bandwidth * _BANDWIDTH_EFFICIENCY,
        bf16_flops=bf16 * _MATMUL_EFFICIENCY,
        fp32_flops=fp32 * _MATMUL_EFFICIENCY,
        h2d_bandwidth=pcie * _PCIE_EFFICIENCY,
        nominal=True,
    )


def default_cache_dir() -> str:
    return envs.read(envs.CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "hybridllm")


def profile_key(hw: HardwareInfo) -> str:
    """What measured numbers depend on; simulated GPUs are not part of it."""
    import torch

    real_gpus = ",".join(g.name for g in hw.gpus if not g.simulated)
    return (
        f"v{_PROFILE_VERSION}|{hw.cpu_model}|{hw.physical_cores}p{hw.logical_cores}l"
        f"|{len(hw.cpu_affinity)}a|{real_gpus}|torch {torch.__version__}"
    )


def load_or_measure_profile(
    hw: HardwareInfo, cache_dir: str | None = None, refresh: bool = False
) -> HardwareProfile:
    """The cached profile of this machine, measuring (about 3 s of CPU, more per GPU) on a miss."""
    key = profile_key(hw)
    path = os.path.join(
        cache_dir or default_cache_dir(),
        f"hardware_profile_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json",
    )
    measured = None if refresh else _read_cache(path, key)
    if measured is None:
        real = [g for g in hw.gpus if not g.simulated]
        logger.info("measuring hardware rates (cached in %s)", path)
        measured = HardwareProfile(
            measure_cpu_rates(len(hw.cpu_affinity)), tuple(measure_gpu_rates(g.index) for g in real)
        )
        _write_cache(path, key, measured)
    return _with_simulated_gpus(measured, hw.gpus)


def _with_simulated_gpus(measured: HardwareProfile, gpus: tuple[GpuInfo, ...]) -> HardwareProfile:
    """Rates for every GPU of `gpus` in index order: measured for real ones, nominal for fakes."""
    real = iter(measured.gpus)
    rates = [nominal_gpu_rates(g.name) if g.simulated else next(real) for g in gpus]
    return HardwareProfile(measured.cpu, tuple(rates))


def _read_cache(path: str, key: str) -> HardwareProfile | None:
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") != key:
            return None
        return HardwareProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or stale cache: measure again


def _write_cache(path: str, key: str, profile: HardwareProfile) -> None:
    record = {"key": key, "measured_at": time.time(), "profile": profile.to_dict()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        logger.warning("could not cache the hardware profile in %s: %s", path, exc)


def measure_cpu_rates(threads: int, budget_s: float = 2.0) -> CpuRates:
    """Read bandwidth and batch-64 GEMM rates of the CPU with `threads` threads (~`budget_s` s)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        # 256 MiB: far beyond any last-level cache, so the sum streams from DRAM.
        x = torch.ones(64 << 20, dtype=torch.float32)  # [64Mi] fp32
        bandwidth = x.numel() * 4 / best_time(x.sum, 5, budget_s * 0.3)
        del x
        # Batch 64 against a 4096 x 4096 weight: the shape of a batched decode step.
        gemm_flops = 2 * 64 * 4096 * 4096
        rates = {}
        for dtype in (torch.float32, torch.bfloat16):
            # Constant values: GEMM speed does not depend on them, and filling is cheaper.
            a = torch.full((64, 4096), 0.5, dtype=dtype)  # [batch, in]
            w = torch.full((4096, 4096), 0.01, dtype=dtype)  # [out, in]
            rates[dtype] = gemm_flops / best_time(
                lambda a=a, w=w: cpu_matmul(a, w), 5, budget_s * 0.3
            )
        blocks = measure_block_read_rate(budget_s * 0.1)
        block_gemm = measure_block_gemm_rate(budget_s * 0.1)
        return CpuRates(
            bandwidth, rates[torch.float32], rates[torch.bfloat16], threads, blocks, block_gemm
        )
    finally:
        torch.set_num_threads(saved)


def q4_1_blocks(rows: int, in_features: int):
    """[rows, bytes a row] of Q4_1 blocks with d = 1.0 (fp16 0x3C00), m = 0 and zero nibbles:
    the op's speed does not depend on the values."""
    import torch

    block_bytes = 20  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
    blocks = torch.zeros(rows, in_features // 32, block_bytes, dtype=torch.uint8)
    blocks[..., 1] = 0x3C
    return blocks.view(rows, in_features // 32 * block_bytes)


def measure_block_read_rate(budget_s: float) -> float | None:
    """Bytes/s of Q4_1 blocks `gguf_linear` reads at batch 1 from 128 MiB of them (a decode
    step of a CPU worker on a 4-bit GGUF); None where the native op is unavailable."""
    import torch
    from gguf import GGMLQuantizationType

    from hybridllm.layers.cpu_kernels import load_cpu_kernels
    from hybridllm.layers.gguf_linear import gguf_linear

    if not load_cpu_kernels():
        return None
    in_features = 4096
    qweight = q4_1_blocks((128 << 20) // (in_features // 32 * 20), in_features)
    x = torch.full((1, in_features), 0.5)  # [1, in]
    q4_1 = int(GGMLQuantizationType.Q4_1)
    seconds = best_time(lambda: gguf_linear(x, qweight, q4_1, qweight.shape[0]), 5, budget_s)
    return qweight.nbytes / seconds


def measure_block_gemm_rate(budget_s: float) -> float | None:
    """FLOP/s of `gguf_linear` on 4096 x 4096 Q4_1 blocks at batch 64 (as measure_cpu_rates'
    float GEMMs), with the activations a model's linears use; None without the native op."""
    import torch
    from gguf import GGMLQuantizationType

    from hybridllm.layers.cpu_kernels import load_cpu_kernels
    from hybridllm.layers.gguf_linear import gguf_linear

    if not load_cpu_kernels():
        return None
    qweight = q4_1_blocks(4096, 4096)
    x = torch.full((64, 4096), 0.5)  # [batch, in]
    q4_1 = int(GGMLQuantizationType.Q4_1)
    seconds = best_time(lambda: gguf_linear(x, qweight, q4_1, 4096), 5, budget_s)
    return 2 * 64 * 4096 * 4096 / seconds


def cpu_matmul(a, w):
    """`a @ w.T` as a CPU worker computes it: fp32 through the native op where the model
    would use it (see `own_f32_gemm_preferred`), else torch's BLAS."""
    import torch

    from hybridllm.layers.gguf_linear import GGML_F32, gguf_linear, own_f32_gemm_preferred

    if a.dtype == torch.float32 and own_f32_gemm_preferred():
        return gguf_linear(a, w.view(torch.uint8), GGML_F32, w.shape[0])
    return a @ w.t()


def measure_gpu_rates(index: int) -> GpuRates:
    """Bandwidth, bf16/fp32 GEMM and pinned host->device copy rates of cuda:`index` (~1 s)."""
    import torch

    device = torch.device("cuda", index)
    with torch.cuda.device(device):
        x = torch.ones(GiB // 4, dtype=torch.float32, device=device)  # 1 GiB
        bandwidth = GiB / cuda_best_time(x.sum)
        x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        bf16 = 2 * 8192**3 / cuda_best_time(lambda: x @ x)
        x = torch.randn(4096, 4096, dtype=torch.float32, device=device)
        fp32 = 2 * 4096**3 / cuda_best_time(lambda: x @ x)
        host = torch.ones(GiB // 16, dtype=torch.float32).pin_memory()  # 256 MiB pinned
        x = torch.empty_like(host, device=device)
        h2d = GiB / 4 / cuda_best_time(lambda: x.copy_(host, non_blocking=True), repeats=5)
        x = host = None  # free before empty_cache hands the memory back
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device)
    return GpuRates(name, bandwidth, bf16, fp32, h2d, nominal=False)


def cuda_best_time(fn: Callable[[], object], repeats: int = 10) -> float:
    """Best time of `fn`'s work on the current CUDA stream, by CUDA events (after a warm-up)."""
    import torch

    fn()  # warm-up: kernels selected, memory allocated
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
    return best


def best_time(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of `fn` over up to `repeats` runs (after one warm-up), within `budget_s`."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best
