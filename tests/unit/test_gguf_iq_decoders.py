"""The IQ grid types' code-block decoders (gguf_iq_blocks.h) against gguf.quants, bit for bit.

gguf cannot quantize these types, so the blocks are random bytes with their fp16 fields set to
normal halves, plus edge blocks (every scale at its largest and smallest, the largest and
smallest grid indices, extreme d). The decoders are checked through hybridllm::gguf_dequantize,
and, built by hand without torch (benchmarks/bench_iq_decode.cpp), on each of the AVX-512,
AVX2 and scalar paths this machine runs: each path's CodeBlocks are the same bytes.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from tests.kernel_helpers import require_cpu_kernels

Q = GGMLQuantizationType
IQ_TYPES = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M]
ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "hybridllm/layers/csrc"


def set_iq1_m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M keeps its fp16 d in the top nibbles of its four uint16 scale words (bytes 48-55)."""
    bits = d.astype(np.float16).view(np.uint16).astype(np.uint16)
    words = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
    for j in range(4):
        nibble = (bits >> (4 * j)) & 0xF
        words[:, j] = (words[:, j] & 0x0FFF) | (nibble << 12)
    blocks[:, 48:56] = words.view(np.uint8)


def set_d(qtype: Q, blocks: np.ndarray, d: np.ndarray) -> None:
    if qtype == Q.IQ1_M:
        set_iq1_m_d(blocks, d)
    else:
        blocks[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def normal_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """Small normal fp16 values of either sign: magnitudes 2^-14 .. 2^-2."""
    magnitude = np.exp2(rng.uniform(-14, -2, n)).astype(np.float16)
    return np.where(rng.random(n) < 0.5, -magnitude, magnitude).astype(np.float16)


def random_blocks(qtype: Q, n: int, seed: int = 0) -> np.ndarray:
    """[n, type_size] uint8: random bytes, d a small normal half; then edge blocks."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    set_d(qtype, blocks, normal_halves(rng, n))
    edges = np.concatenate(
        [np.full((4, size), 0xFF, np.uint8), np.zeros((4, size), np.uint8)], axis=0
    )
    # the largest and smallest normal halves, a small one and a subnormal, of either sign
    edge_d = np.array([65504, -6.1035156e-05, 1.0, -5.9604645e-08] * 2, dtype=np.float16)
    set_d(qtype, edges, edge_d)
    return np.concatenate([blocks, edges], axis=0)


def gguf_reference(qtype: Q, blocks: np.ndarray) -> np.ndarray:
    return gguf_dequantize(blocks, qtype).reshape(blocks.shape[0], -1).astype(np.float32)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_gguf_dequantize_equals_gguf(qtype):
    require_cpu_kernels()
    blocks = random_blocks(qtype, 4000, seed=int(qtype))
    rows = 8  # super-blocks of 256 weights: rows of K = 256 * (blocks / rows)
    blocks = blocks[: blocks.shape[0] // rows * rows]
    K = 256 * blocks.shape[0] // rows
    want = gguf_reference(qtype, blocks).reshape(rows, K)
    got = torch.ops.hybridllm.gguf_dequantize(
        torch.from_numpy(blocks.reshape(rows, -1).copy()), int(qtype), K
    ).numpy()
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# --- the decoders without torch: each SIMD path this machine runs, and its CodeBlocks ---------

# The compiler flags of each path (AVX-512 with VBMI takes permutes for IQ2_XXS and IQ3_XXS,
# without it gathers); a path runs only where the CPU has the features it names.
PATHS = {
    "avx512vbmi": ["-march=native"],
    "avx512bw": ["-march=native", "-mno-avx512vbmi"],
    "avx2": ["-march=x86-64-v3"],
    "scalar": ["-march=x86-64"],
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory) -> dict[str, Path]:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    flags = _cpu_flags()
    runnable = {"scalar"}
    if "avx2" in flags:
        runnable.add("avx2")
    if {"avx512bw", "avx512vl"} <= flags:
        runnable.add("avx512bw")
        if "avx512vbmi" in flags:
            runnable.add("avx512vbmi")
    out = tmp_path_factory.mktemp("iq_decode")
    built = {}
    for path, path_flags in PATHS.items():
        if path not in runnable:
            continue
        exe = out / f"bench_{path}"
        cmd = [compiler, "-O2", *path_flags, "-std=c++17", f"-I{CSRC}"]
        cmd += [str(ROOT / "benchmarks/bench_iq_decode.cpp"), "-o", str(exe)]
        subprocess.run(cmd, check=True, timeout=300, capture_output=True)
        built[path] = exe
    return built


def dump(exe: Path, qtype: Q, blocks: np.ndarray):
    """The harness's CodeBlocks: codes [n, 256] int8, scales [n, 16] int16, d [n] float32."""
    n = blocks.shape[0]
    done = subprocess.run(
        [str(exe), "dump", str(int(qtype)), str(n)],
        input=blocks.tobytes(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    record = np.dtype([("codes", np.int8, 256), ("scales", "<i2", 16), ("d", "<f4")])
    out = np.frombuffer(done.stdout, dtype=record)
    assert out.shape == (n,)
    return out["codes"], out["scales"], out["d"]


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_every_path_decodes_the_same_exact_code_blocks(harnesses, qtype):
    blocks = random_blocks(qtype, 2000, seed=100 + int(qtype))
    want = gguf_reference(qtype, blocks)
    first = None
    for path, exe in harnesses.items():
        codes, scales, d = dump(exe, qtype, blocks)
        assert np.abs(codes.astype(np.int32)).max() <= 127 and np.abs(scales).max() <= 127
        # (d * scale) * code in fp32, as the kernels compute it
        scale = (d[:, None] * scales.astype(np.float32)).astype(np.float32)
        got = (np.repeat(scale, 16, axis=1) * codes.astype(np.float32)).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=path)
        if first is None:
            first = (path, codes, scales, d)
        else:
            assert np.array_equal(codes, first[1]), (path, first[0])
            assert np.array_equal(scales, first[2]), (path, first[0])
            assert np.array_equal(d.view(np.uint32), first[3].view(np.uint32)), (path, first[0])


# --- the generated grid header ----------------------------------------------------------------


def test_grid_header_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("gen_iq_grids", ROOT / "scripts/gen_iq_grids.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (CSRC / "gguf_iq_grids.h").read_text() == module.render()
