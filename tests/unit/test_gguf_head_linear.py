"""hybridllm::gguf_head_linear: H per-head GGUF matrices (DeepSeek MLA's absorbed W_UK^T, W_UV)
against einsum over the dequantized weights, and against gguf_linear called head by head."""

from __future__ import annotations

import functools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tests.gguf_random_blocks import FP16_OFFSETS
from tests.gguf_random_blocks import random_blocks as random_code_blocks
from tests.kernel_helpers import require_cpu_kernels
from tests.unit.test_gguf_int8_kernel import quantize_x
from tests.unit.test_gguf_linear_kernel import quantized_weight, random_blocks

Q = GGMLQuantizationType
# the gguf package quantizes these; the K-quants are random blocks (as the gguf_linear tests)
QUANTIZED = [Q.Q8_0, Q.Q4_0, Q.Q5_0]
K_QUANTS = [Q.Q4_K, Q.Q6_K]
# (in, out): W_UK^T's [512, 128] (llama.cpp: Q5_0, 128 not a multiple of 256) and W_UV's [128, 512]
SHAPES = [(128, 512), (512, 128)]


@pytest.fixture(scope="module")
def op():
    require_cpu_kernels()
    return torch.ops.hybridllm.gguf_head_linear


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@functools.cache
def head_weights(fmt, heads: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [heads, n, row_bytes] uint8, its dequantized values [heads, n, k] fp32)."""
    make = quantized_weight if fmt in QUANTIZED else random_blocks
    raw, weight = make(fmt, heads * n, k, seed=heads + k)
    return raw.reshape(heads, n, -1), weight.reshape(heads, n, k)


def per_head(x, qweight, fmt, n, activations):
    """gguf_linear called once a head: [B, H, n]."""
    return torch.stack(
        [
            torch.ops.hybridllm.gguf_linear(x[:, h], qweight[h], int(fmt), n, activations)
            for h in range(x.shape[1])
        ],
        dim=1,
    )


def check_fp32(y, x, weight):
    ref = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
    # fp32 sums of at most 512 terms, as test_gguf_linear_kernel's check
    bound = 1e-5 * torch.einsum("bhk,hnk->bhn", x.double().abs(), weight.double().abs()) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"


def check_int8(y, x, weight, fmt):
    # test_gguf_int8_kernel's check_int8, a head at a time
    b, h, k = x.shape
    xq, d = (t.reshape(b, h, k) for t in quantize_x(x.reshape(b * h, k), GGML_QUANT_SIZES[fmt][0]))
    w = weight.double()
    ref = torch.einsum("bhk,hnk->bhn", xq.double(), w)
    bound = 1e-5 * torch.einsum("bhk,hnk->bhn", xq.double().abs(), w.abs()) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} vs the quantized x"
    exact = torch.einsum("bhk,hnk->bhn", x.double(), w)
    tolerance = torch.einsum("bhk,hnk->bhn", d.double() / 2, w.abs()) + 1e-5 * torch.einsum(
        "bhk,hnk->bhn", x.double().abs(), w.abs()
    )
    assert ((y.double() - exact).abs() <= tolerance).all()


def assert_same_as_per_head(y, x, qweight, fmt, n, activations):
    # the same kernels: equal up to the order of fp32 sums (where the threads' runs of weight
    # rows start at other rows than gguf_linear's)
    expected = per_head(x, qweight, fmt, n, activations)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("heads", [1, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("fmt", QUANTIZED + K_QUANTS, ids=lambda f: f.name)
def test_heads_against_einsum_and_gguf_linear(op, fmt, shape, heads, batch):
    k, n = shape
    if k % GGML_QUANT_SIZES[fmt][0]:
        pytest.skip(f"{fmt.name} rows need a multiple of {GGML_QUANT_SIZES[fmt][0]} inputs")
    qweight, weight = head_weights(fmt, heads, k, n)
    x = torch.randn(batch, heads, k)
    y = op(x, qweight, int(fmt), n)
    assert y.dtype == torch.float32 and y.shape == (batch, heads, n) and y.is_contiguous()
    check_fp32(y, x, weight)
    assert_same_as_per_head(y, x, qweight, fmt, n, 0)
    y8 = op(x, qweight, int(fmt), n, 1)
    assert y8.shape == (batch, heads, n)
    check_int8(y8, x, weight, fmt)
    assert_same_as_per_head(y8, x, qweight, fmt, n, 1)


def test_every_int8_path(op):
    qweight, weight = head_weights(Q.Q5_0, 128, 128, 512)
    x = torch.randn(3, 128, 128)
    for path in torch.ops.hybridllm.gguf_int8_paths():
        y = op(x, qweight, int(Q.Q5_0), 512, path)
        check_int8(y, x, weight, Q.Q5_0)
        assert_same_as_per_head(y, x, qweight, Q.Q5_0, 512, path)


@pytest.mark.parametrize("batch", [9, 40])
def test_larger_batches(op, batch):
    # more rows than the direct kernel's 8-row tile (fp32) and the int8 row tile; gguf_linear
    # itself switches to GEMMs here, so only the reference
    qweight, weight = head_weights(Q.Q4_K, 6, 512, 128)
    x = torch.randn(batch, 6, 512)
    check_fp32(op(x, qweight, int(Q.Q4_K), 128), x, weight)
    check_int8(op(x, qweight, int(Q.Q4_K), 128, 1), x, weight, Q.Q4_K)


def test_strided_x(op):
    qweight, weight = head_weights(Q.Q8_0, 128, 128, 512)
    # q_nope as a slice of q [B, H, 192], and a transposed [H, B, 128]
    sliced = torch.randn(2, 128, 192)[..., :128]
    transposed = torch.randn(128, 2, 128).transpose(0, 1)
    for x in (sliced, transposed):
        check_fp32(op(x, qweight, int(Q.Q8_0), 512), x, weight)
        check_int8(op(x, qweight, int(Q.Q8_0), 512, 1), x, weight, Q.Q8_0)


# every other type gguf_linear computes: the same kernels, so the same values as head by head
OTHER_TYPES = [Q.F32, Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.Q5_K, *FP16_OFFSETS]


@pytest.mark.parametrize("fmt", OTHER_TYPES, ids=lambda f: f.name)
def test_other_types_equal_gguf_linear(op, fmt):
    heads, k, n = 3, 256, 40
    if fmt == Q.F32:
        qweight = torch.randn(heads, n, k).view(torch.uint8)
    elif fmt in FP16_OFFSETS:
        qweight = random_code_blocks(int(fmt), heads * n, k, torch.Generator().manual_seed(1))
    elif fmt in (Q.Q4_1, Q.Q5_1):  # fp16 d and m: the gguf package's quantizer
        qweight = quantized_weight(fmt, heads * n, k, seed=1)[0]
    else:  # IQ4_NL, Q5_K
        qweight = random_blocks(fmt, heads * n, k, seed=1)[0]
    qweight = qweight.reshape(heads, n, -1)
    x = torch.randn(2, heads, k)
    for activations in (0, 1):
        y = op(x, qweight, int(fmt), n, activations)
        assert_same_as_per_head(y, x, qweight, fmt, n, activations)


def test_x8_weights(op):
    if int(Q.Q4_K) not in torch.ops.hybridllm.x8_source_types():
        pytest.skip("this build computes no Q4_K in x8 groups")
    qweight, weight = head_weights(Q.Q4_K, 4, 512, 128)
    x8 = torch.ops.hybridllm.repack_x8(qweight, int(Q.Q4_K))
    x = torch.randn(2, 4, 512)
    y = op(x, x8, 112, 128, 1)
    check_int8(y, x, weight, Q.Q4_K)
    assert_same_as_per_head(y, x, x8, 112, 128, 1)
    with pytest.raises(RuntimeError, match="x8 weights"):
        op(x, x8, 112, 128, 0)


def test_empty(op):
    qweight, _ = head_weights(Q.Q8_0, 1, 128, 512)
    assert op(torch.randn(0, 1, 128), qweight, int(Q.Q8_0), 512).shape == (0, 1, 512)


def test_bad_arguments(op):
    qweight, _ = head_weights(Q.Q8_0, 128, 128, 512)
    q8 = int(Q.Q8_0)
    x = torch.randn(1, 128, 128)
    bad = [
        ((x.double(), qweight, q8, 512), "x must be float32"),
        ((x[0], qweight, q8, 512), "x must be 3-D"),
        ((x, qweight.view(torch.int8), q8, 512), "qweight must be uint8"),
        ((x, qweight, 99, 512), "unsupported ggml_type 99"),
        ((x[..., :100], qweight, q8, 512), "not a multiple of"),
        ((x, qweight, q8, -1), "out_features must be >= 0"),
        ((x[:, :64], qweight, q8, 512), "does not match 64 heads"),
        ((x, qweight, q8, 256), "does not match"),
        ((x, qweight[:, :, :-2], q8, 512), "does not match"),
        ((x, qweight.transpose(0, 1).contiguous().transpose(0, 1), q8, 512), "contiguous"),
        ((x, qweight, q8, 512, 7), "activations must be 0"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            op(*args)
