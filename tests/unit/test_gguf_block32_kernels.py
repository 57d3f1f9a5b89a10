"""Q5_0, Q5_1, IQ4_NL and MXFP4 computed from their 32-weight blocks: the fallback types K-quant
files carry where a row is not a whole number of 256-weight super-blocks (SmolLM2's 576), and
gpt-oss's experts (MXFP4, rows of 2880). Decoding
against gguf's reference bit for bit, fp32 and int8 activations on every path against fp64, the
int8 GEMM against the few-rows kernels, and fused_moe over experts of two of these types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from hybridllm.layers.moe_routing import select_experts
from tests.kernel_helpers import require_cpu_kernels
from tests.unit.test_fused_moe import per_expert_int8
from tests.unit.test_gguf_int8_kernel import PATH_NAMES, built_paths, check_int8
from tests.unit.test_gguf_linear_kernel import ROW_COUNTS, check

Q = GGMLQuantizationType
TYPES = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4]
QUANTIZABLE = [Q.Q5_0, Q.Q5_1, Q.MXFP4]  # gguf has no IQ4_NL quantizer
# weight rows x inputs: 1, 3 (a partial quad of blocks), 18 (SmolLM2's 576) and 80 blocks a row
SHAPES = [(37, 32), (13, 96), (67, 576), (29, 2560)]
INT8_ROW_COUNTS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 33, 70]


@pytest.fixture(scope="module")
def ops():
    require_cpu_kernels()
    return torch.ops.hybridllm


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_blocks(fmt, n, k, seed=0):
    """Uniformly random block bytes (every nibble and fifth-bit pattern) with small normal fp16
    scales of either sign (and Q5_1 mins), MXFP4's E8M0 exponents 2^-12 .. 2^-3 (its own
    decoding test adds every exponent): raw [n, bytes a row] and gguf's fp32 decoding."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = GGML_QUANT_SIZES[fmt]
    raw = rng.integers(0, 256, size=(n * k // block_size, block_bytes), dtype=np.uint8)
    if fmt == Q.MXFP4:
        raw[:, 0] = rng.integers(116, 126, size=len(raw), dtype=np.uint8)
    else:
        scale_count = 2 if fmt == Q.Q5_1 else 1
        scales = (rng.standard_normal((len(raw), scale_count)) * 0.02).astype(np.float16)
        raw[:, : 2 * scale_count] = scales.view(np.uint8)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, fmt).reshape(n, k))


def quantized_blocks(fmt, n, k, seed=0):
    """Random normal [n, k] weights through gguf's quantizer."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, fmt)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, fmt).reshape(n, k))


def weights_of(fmt, n, k, seed=0):
    """The blocks the tests run on: both kinds for a type gguf quantizes, random ones else."""
    kinds = [random_blocks] + ([quantized_blocks] if fmt in QUANTIZABLE else [])
    return [kind(fmt, n, k, seed) for kind in kinds]


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_dequantize_equals_gguf_bit_for_bit(ops, fmt):
    for n, k in SHAPES + [(300, 1536)]:
        for raw, weight in weights_of(fmt, n, k, seed=n):
            got = ops.gguf_dequantize(raw, int(fmt), k)
            assert torch.equal(got.view(torch.int32), weight.view(torch.int32))


def test_mxfp4_every_exponent_decodes_as_gguf(ops):
    # E8M0 bytes 0 .. 255: the subnormal halves (0, 1), 2^127 / 2 (254) and 255, whose largest
    # codes overflow to inf in fp32 as in gguf's decoding
    raw, _ = random_blocks(Q.MXFP4, 256, 64, seed=5)
    raw.view(-1, 17)[:, 0] = torch.arange(256, dtype=torch.uint8).repeat_interleave(2)
    want = torch.from_numpy(dequantize(raw.numpy(), Q.MXFP4).reshape(256, 64))
    got = ops.gguf_dequantize(raw, int(Q.MXFP4), 64)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda s: str(s))
def test_fp32_activations_match_fp64(ops, fmt, n, k):
    # the direct kernel (<= 24 rows), the panel GEMM and, on an Intel CPU, BLAS on decoded rows
    for raw, weight in weights_of(fmt, n, k, seed=n):
        for m in ROW_COUNTS:
            check(ops.gguf_linear, torch.randn(m, k), raw, weight, fmt)


@pytest.mark.parametrize("path", [1, 2, 3, 4, 5], ids=lambda p: PATH_NAMES.get(p, "best"))
@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_int8_activations_on_every_path(ops, fmt, path):
    if path != 1 and path not in built_paths():
        pytest.skip(f"this build has no {PATH_NAMES[path]} path")
    rows = INT8_ROW_COUNTS
    for n, k in SHAPES + [(100, 2560), (24, 2880)]:
        for raw, weight in weights_of(fmt, n, k, seed=n):
            for m in rows:
                check_int8(ops.gguf_linear, torch.randn(m, k), raw, weight, fmt, path)


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_int8_outliers_and_zero_groups(ops, fmt):
    raw, weight = random_blocks(fmt, 40, 576, seed=3)
    x = torch.randn(4, 576)
    x[0] = 0
    x[1, :64] = 0
    x[2, 5] = 1e4
    x[3] *= 1e-30
    for path in built_paths():
        check_int8(ops.gguf_linear, x, raw, weight, fmt, path)


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_int8_gemm_equals_the_few_rows_kernels(ops, fmt):
    # M >= 8: the int8 GEMM, whose integer sums are exact: the scalar few-rows kernel (forced
    # past the GEMM's row count) up to fp32 rounding
    if not {2, 4} & set(built_paths()):
        pytest.skip("no int8 GEMM in this build (it needs AVX512-VNNI or AVX2)")
    for n, k in [(45, 576), (100, 2560), (7, 96)]:
        raw, _ = random_blocks(fmt, n, k, seed=4)
        for m in (8, 40):
            x = torch.randn(m, k)
            gemm, scalar = (ops.gguf_linear(x, raw, int(fmt), n, path) for path in (1, 5))
            assert not torch.equal(gemm, ops.gguf_linear(x, raw, int(fmt), n, 0))
            torch.testing.assert_close(
                gemm, scalar, rtol=1e-5, atol=1e-5 * scalar.abs().max().item()
            )


def per_expert_fp32(x, weights, ids, w13, t13, w2, t2):
    """hybridllm::gguf_linear (fp32 activations) once per active expert, outputs added in expert
    order."""
    linear, inter = torch.ops.hybridllm.gguf_linear, w13.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        gate_up = linear(x[tokens], w13[e], t13, 2 * inter)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out[tokens] += weights[tokens, slots, None] * linear(act, w2[e], t2, x.shape[1])
    return out


@pytest.mark.parametrize(
    "t13,t2",
    [(Q.Q5_0, Q.IQ4_NL), (Q.IQ4_NL, Q.Q5_1), (Q.MXFP4, Q.MXFP4)],
    ids=lambda t: t.name,
)
def test_fused_moe_of_two_types_equals_a_loop_of_gguf_linear(ops, t13, t2):
    experts, top_k, inter, hidden = 6, 2, 96, 576
    w13 = random_blocks(t13, experts * 2 * inter, hidden, 8)[0].view(experts, 2 * inter, -1)
    w2 = random_blocks(t2, experts * hidden, inter, 9)[0].view(experts, hidden, -1)
    g = torch.Generator().manual_seed(3)
    for num_tokens in (1, 4, 30):
        x = torch.randn(num_tokens, hidden, generator=g)
        logits = torch.randn(num_tokens, experts, generator=g)
        logits[:, 1] += 3.0  # expert 1 takes every token: past the int8 GEMM's 8 rows at 30
        weights, ids = select_experts(logits, top_k)
        # the same kernels; the op's SiLU differs from F.silu by fp32 rounding, which the down
        # projection's cancellations carry into outputs near zero: atol relative to the largest
        got = ops.fused_moe(x, weights, ids, w13, int(t13), w2, int(t2), 0)
        want = per_expert_fp32(x, weights, ids, w13, int(t13), w2, int(t2))
        atol = 1e-6 * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
        for path in ops.gguf_int8_paths():
            got = ops.fused_moe(x, weights, ids, w13, int(t13), w2, int(t2), path)
            want = per_expert_int8(x, weights, ids, w13, int(t13), w2, int(t2), path)
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
