"""Optional native CPU kernels (decode attention, MLA decode attention, KV cache writes, GGUF
linear, RMSNorm, SiLU-and-mul, rotary embedding, argmax, fused MoE, whole decoder layer,
Gated DeltaNet),
compiled on first use.

The kernels are a speed-up, never a requirement: when there is no C++ compiler, the build
fails, or `HYBRIDLLM_CPU_KERNELS=0` is set, `load_cpu_kernels` returns False and the plain
torch path runs instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from hybridllm import envs, progress
from hybridllm.loader.gguf_cache import cache_root

logger = logging.getLogger(__name__)

DISABLE_ENV = envs.CPU_KERNELS.name
NAME = "hybridllm_cpu_kernels"
# All sources build into the one library: torch_bindings.cpp declares every op's schema under
# torch.ops.hybridllm, and each kernel file registers its implementations.
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "torch_bindings.cpp",
        "paged_decode_cpu.cpp",
        "mla_decode_cpu.cpp",
        "gguf_linear_cpu.cpp",
        "gguf_q8_linear_cpu.cpp",
        "gguf_q8_gemm_cpu.cpp",
        "gguf_q8_gemm_avx2_cpu.cpp",
        "gguf_dequantize_cpu.cpp",
        "gguf_x8_cpu.cpp",
        "gguf_x8_code_cpu.cpp",
        "gguf_x8_block_cpu.cpp",
        "gguf_x8_avx2_cpu.cpp",
        "gguf_x8_code_avx2_cpu.cpp",
        "gguf_x8_grid_cpu.cpp",
        "rms_norm_cpu.cpp",
        "activation_cpu.cpp",
        "argmax_cpu.cpp",
        "rotary_cpu.cpp",
        "kv_cache_write_cpu.cpp",
        "fused_moe_cpu.cpp",
        "decode_layer_cpu.cpp",
        "decode_stack_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "gguf_head_linear_cpu.cpp",
        "gated_delta_net_cpu.cpp",
    )
]
# Headers the sources include: part of the build's identity, like the sources.
HEADERS = sorted(CSRC.glob("*.h"))
# -march=native ties the binary to this CPU, so the build directory is keyed by its features.
# No -ffast-math: on some compilers it links code that changes the whole process's denormal mode.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17"]


def _cpu_fingerprint() -> str:
    """A short hash of the CPU model and feature flags (Linux), else of the platform string."""
    text = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text = "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def kernel_build_dir() -> Path:
    """Where this torch, CPU and source tree's library is built: the directory names everything
    the binary depends on, so a built library is loaded as is."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    source_hash = digest.hexdigest()
    tag = f"torch{torch.__version__}-{_cpu_fingerprint()}-{source_hash[:12]}".replace("+", "_")
    return Path(cache_root()) / "cpu_kernels" / tag


@functools.cache  # one build (and one op registration) per process
def load_cpu_kernels() -> bool:
    """Build/load the native ops into `torch.ops.hybridllm`; True when they are available."""
    if not envs.read(envs.CPU_KERNELS):
        return False
    build_dir = kernel_build_dir()
    library = build_dir / f"{NAME}.so"
    try:
        # cpp_extension holds `lock` while it builds; until then the library may be partial
        if library.exists() and not (build_dir / "lock").exists():
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        # One builder at a time. The OS drops a flock when its holder dies, unlike
        # cpp_extension's `lock` file, which a killed build leaves behind for every later
        # process to wait on forever: holding the flock, any such file is stale. ninja then
        # rebuilds whatever the killed build left unfinished.
        with open(build_dir / "build.flock", "a") as guard:
            _lock_build(guard, build_dir)
            (build_dir / "lock").unlink(missing_ok=True)
            # Minutes without a word look like a hang: say what runs and for about how long.
            with progress.long_step(
                "building the native CPU kernels",
                done="built the native CPU kernels",
                estimate=f"once per machine and version; {_build_estimate()}",
            ):
                cpp_extension.load(
                    name=NAME,
                    sources=[str(source) for source in SOURCES],
                    extra_cflags=CFLAGS,
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("native CPU kernels unavailable (%s); using the torch paths", e)
        return False
    return True


def cpu_kernels_enabled(requested: bool) -> bool:
    """Whether a CPU worker computes with the native kernels: its engine config asks for them
    (`requested`, `--cpu-kernels`) and they are built and loadable in this process."""
    return requested and load_cpu_kernels()


# One source takes about 10-20 s of one core to compile (torch's headers are most of it);
# ninja compiles as many at once as there are cores.
_COMPILE_SECONDS = (10, 20)


def _build_estimate() -> str:
    """About how long the build takes here, e.g. "about 1-2 minutes on 2 cores"."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, cores or 1)
    rounds = -(-len(SOURCES) // cores)  # ceil: the sources compile in waves of `cores`
    # Other work shares the cores: a load of 7 per core made a 70 s build take 9 minutes.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    share = max(1.0, load / cores)
    low, high = (round(rounds * seconds * share) for seconds in _COMPILE_SECONDS)
    span = f"{low}-{high} s" if high < 120 else f"{round(low / 60)}-{round(high / 60)} minutes"
    busy = f", busy (load {load:.0f})" if share > 1 else ""
    return f"about {span} on {cores} core{'s' if cores > 1 else ''}{busy}"


def _lock_build(guard: object, build_dir: Path) -> None:
    """Take the build lock, saying so when another process holds it (it is building)."""
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        progress.logger.info(
            "waiting for another process building the native CPU kernels in %s", build_dir
        )
        fcntl.flock(guard, fcntl.LOCK_EX)
