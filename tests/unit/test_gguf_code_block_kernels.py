"""The native kernels of the GGUF types computed as code blocks (csrc/gguf_code_blocks.h), every
type of CODE_BLOCK_TYPES on every path: decoding, fp32 activations, int8 activations (few rows
and the GEMM), and fused_moe with experts of two such types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from hybridllm.loader.gguf_kernel_types import CODE_BLOCK_TYPES, OWN_KERNEL_TYPES
from tests.gguf_helpers import random_k_quant_blocks
from tests.gguf_random_blocks import random_blocks
from tests.kernel_helpers import require_cpu_kernels
from tests.unit.test_fused_moe import per_expert_int8
from tests.unit.test_gguf_int8_kernel import PATH_NAMES, check_int8, quantize_x

Q = GGMLQuantizationType
TYPES = [Q(t) for t in CODE_BLOCK_TYPES]
GROUP = 256  # x's int8 groups for every code-block type (q8_group)
# fp32: 1-24 the code-block rows kernel (1-3 and 5 leave a partial 4-row tile), then the
# dequantized paths (panel GEMM, BLAS)
FP32_ROWS = [1, 2, 3, 4, 5, 8, 24, 25, 33, 129]
# int8: 1-7 the few-rows kernels (a 4-row tile, a partial one), from 8 the GEMM on paths 1-2
INT8_ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 33]


@pytest.fixture(scope="module")
def ops():
    require_cpu_kernels()
    return torch.ops.hybridllm


@pytest.fixture(scope="module")
def paths(ops):
    return list(ops.gguf_int8_paths())


def weight(fmt, rows, k, seed):
    """Random valid blocks [rows, bytes] and gguf's own fp32 decoding of them [rows, k]."""
    blocks = random_blocks(fmt, rows, k, torch.Generator().manual_seed(seed))
    return blocks, torch.from_numpy(dequantize(blocks.numpy(), fmt).reshape(rows, k))


def test_table_and_python_list_agree(ops):
    # the ggml types gguf_dequantize takes are exactly the table's: CODE_BLOCK_TYPES and the rest
    supported = []
    for t in Q:
        if t not in GGML_QUANT_SIZES:
            continue
        block_size, block_bytes = GGML_QUANT_SIZES[t]
        blocks = torch.zeros(1, 256 // block_size * block_bytes, dtype=torch.uint8)
        try:
            ops.gguf_dequantize(blocks, int(t), 256)
        except RuntimeError as e:
            assert "unsupported ggml_type" in str(e) or "no decoder" in str(e), str(e)
            continue
        supported.append(int(t))
    assert sorted(supported) == sorted(CODE_BLOCK_TYPES + OWN_KERNEL_TYPES)


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_dequantize_is_gguf_bit_for_bit(ops, fmt):
    blocks, want = weight(fmt, 41, 1024, 0)
    got = ops.gguf_dequantize(blocks, int(fmt), 1024)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_fp32_activations_match_fp64(ops, fmt):
    for n, k in [(37, 256), (21, 1280)]:
        blocks, w = weight(fmt, n, k, k)
        for m in FP32_ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = ops.gguf_linear(x, blocks, int(fmt), n, 0)
            ref = x.double() @ w.double().T
            bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
            err = (y.double() - ref).abs()
            assert (err <= bound).all(), f"M={m} K={k}: max error {err.max():.3g}"


@pytest.mark.parametrize("path", [1, 2, 3, 4, 5], ids=lambda p: PATH_NAMES.get(p, "best"))
@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_int8_activations_on_every_path(ops, paths, fmt, path):
    if path != 1 and path not in paths:
        pytest.skip(f"this build has no {PATH_NAMES[path]} path")
    # 37 rows: partial 4- and 2-row calls and GEMM micro-kernels; 100 x 2560 spans GEMM panels
    for n, k in [(37, 768), (100, 2560)]:
        blocks, w = weight(fmt, n, k, n)
        for m in INT8_ROWS if k < 2560 else [1, 9]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            check_int8(ops.gguf_linear, x, blocks, w, fmt, path)


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_int8_gemm_equals_the_few_rows_kernels(ops, paths, fmt):
    if not {2, 4} & set(paths):
        pytest.skip("no int8 GEMM in this build (it needs AVX512-VNNI or AVX2)")
    few = next(p for p in paths if p > 2)  # a few-rows path at every M
    blocks, w = weight(fmt, 53, 1536, 1)
    for m in (8, 9, 16, 17, 31, 33, 40):
        x = torch.randn(m, 1536, generator=torch.Generator().manual_seed(m))
        gemm = ops.gguf_linear(x, blocks, int(fmt), 53, 1).double()
        rows = ops.gguf_linear(x, blocks, int(fmt), 53, few).double()
        xq, _ = quantize_x(x, GROUP)
        bound = 2e-6 * (xq.double().abs() @ w.double().abs().T) + 1e-30
        assert ((gemm - rows).abs() <= bound).all(), f"M={m}"


@pytest.mark.parametrize(
    "t13,t2",
    [(t, TYPES[(i + 1) % len(TYPES)]) for i, t in enumerate(TYPES)] + [(TYPES[0], Q.Q4_K)],
    ids=lambda t: t.name,
)
def test_fused_moe_with_experts_of_two_types(ops, t13, t2):
    # gate/up of one type, down of another: every path equals one gguf_linear call per expert
    # (fp32 activations too)
    experts, top_k, inter, hidden = 6, 2, 256, 512
    g = torch.Generator().manual_seed(5)
    w13 = expert_blocks(t13, experts * 2 * inter, hidden, g).view(experts, 2 * inter, -1)
    w2 = expert_blocks(t2, experts * hidden, inter, g).view(experts, hidden, -1)
    for num_tokens in (1, 4, 20):
        x = torch.randn(num_tokens, hidden, generator=g)
        logits = torch.randn(num_tokens, experts, generator=g)
        logits[:, 1] += 3.0  # expert 1 takes every token: 20 rows, the GEMM's side
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).float()
        for path in [0, *ops.gguf_int8_paths()]:
            got = ops.fused_moe(x, weights, ids, w13, int(t13), w2, int(t2), path)
            want = per_expert_int8(x, weights, ids, w13, int(t13), w2, int(t2), path)
            # the same products; the weighted sums of a token's experts may round apart (an
            # FMA in the op), which near a cancellation is far from the result's own ulp
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, atol=1e-6 * scale, rtol=1e-5)


def expert_blocks(fmt, rows, k, g):
    if fmt in CODE_BLOCK_TYPES:
        return random_blocks(fmt, rows, k, g)
    seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
    return torch.from_numpy(random_k_quant_blocks((rows, k), fmt, seed))


@pytest.mark.parametrize("fmt", TYPES, ids=lambda f: f.name)
def test_rows_not_whole_super_blocks_are_refused(ops, fmt):
    block_bytes = GGML_QUANT_SIZES[fmt][1]
    blocks = torch.zeros(3, block_bytes, dtype=torch.uint8)
    for activations in (0, 1):
        with pytest.raises(RuntimeError, match="not a multiple of the block size 256"):
            ops.gguf_linear(torch.zeros(1, 224), blocks, int(fmt), 3, activations)
    with pytest.raises(RuntimeError, match="not a positive multiple of the block size 256"):
        ops.gguf_dequantize(blocks, int(fmt), 224)
    assert np.isfinite(ops.gguf_dequantize(blocks, int(fmt), 256).numpy()).all()
