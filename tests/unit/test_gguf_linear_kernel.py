"""The native hybridllm::gguf_linear op (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks) vs fp64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from hybridllm.loader.gguf_dequant import dequantize
from tests.kernel_helpers import require_cpu_kernels

Q = GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
# kDirectMaxRows in gguf_linear_cpu.cpp: up to this many rows of x the direct kernel runs,
# then the panel GEMM (AVX-512) up to kPanelMaxRows, then, on an Intel CPU, BLAS on decoded
# weights (elsewhere the panels serve every row count). 8 and 9
# straddle the direct kernel's row tile, 33 the panel's 32 rows; at K = 2560 128 rows take two
# of the panel GEMM's m-blocks.
DIRECT_MAX_ROWS = 24
PANEL_MAX_ROWS = 128
ROW_COUNTS = [1, 2, 5, 8, 9, DIRECT_MAX_ROWS, DIRECT_MAX_ROWS + 1, 33, 64]
ROW_COUNTS += [PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1]


@pytest.fixture(scope="module")
def op():
    require_cpu_kernels()
    return torch.ops.hybridllm.gguf_linear


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def quantized_weight(fmt, n, k, seed=0):
    """Random [n, k] weights quantized with gguf's reference: raw blocks [n, k/32*bytes], fp32."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, fmt)
    return torch.from_numpy(raw), dequantize(raw, fmt, (n, k))


def random_blocks(fmt, n, k, seed=0):
    """Uniformly random block bytes (every nibble / int8 pattern) with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = GGML_QUANT_SIZES[fmt]
    raw = rng.integers(0, 256, size=(n * k // block_size, block_bytes), dtype=np.uint8)
    # fp16 d, and Q4_1's m or Q4_K's dmin (K-quants' sub-block scales and mins stay random);
    # Q6_K keeps its d last
    scale_count = 2 if fmt in (Q.Q4_1, Q.Q4_K, Q.Q5_K) else 1
    scales = rng.uniform(-0.1, 0.1, size=(len(raw), scale_count)).astype(np.float16)
    if fmt == Q.Q6_K:
        raw[:, -2:] = scales.view(np.uint8)
    else:
        raw[:, : 2 * scale_count] = scales.view(np.uint8)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw), dequantize(raw, fmt, (n, k))


def check(op, x, qweight, weight, fmt):
    y = op(x, qweight, int(fmt), weight.shape[0])
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], weight.shape[0])
    ref = x.double() @ weight.double().T
    # fp32 accumulation over K <= 2560 terms: each error within ~100 ulp of sum |x||w| (errors
    # seen are ~1 ulp; a single weight decoded 1% wrong already breaks this)
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), (
        f"max error {err.max():.3g}, its bound {bound.flatten()[err.argmax()]:.3g}"
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n,k", [(37, 32), (67, 576), (130, 1536), (29, 2560)])
def test_matches_fp64_reference(op, fmt, n, k):
    qweight, weight = quantized_weight(fmt, n, k)
    for m in ROW_COUNTS:
        check(op, torch.randn(m, k), qweight, weight, fmt)


@pytest.mark.parametrize("fmt", FORMATS + [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda f: f.name)
def test_random_block_bytes(op, fmt):
    # every nibble value, negative scales, and (Q4_1) mins of either sign
    qweight, weight = random_blocks(fmt, 53, 256, seed=1)
    for m in (1, 3, 40):
        check(op, torch.randn(m, 256), qweight, weight, fmt)


@pytest.mark.parametrize("fmt", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda f: f.name)
@pytest.mark.parametrize("n,k", [(37, 256), (67, 512), (29, 2560)])
def test_k_quant_super_blocks_match_fp64_reference(op, fmt, n, k):
    # gguf has no K-quant quantizer: random super-blocks, decoded by gguf's dequantize
    qweight, weight = random_blocks(fmt, n, k, seed=4)
    for m in ROW_COUNTS:
        check(op, torch.randn(m, k), qweight, weight, fmt)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_output_rows_not_a_multiple_of_the_tile(op, m):
    # 1000 rows split into GEMM tiles / thread chunks / row pairs with remainders everywhere
    qweight, weight = quantized_weight(Q.Q4_1, 1001, 576, seed=2)
    check(op, torch.randn(m, 576), qweight, weight, Q.Q4_1)


def test_blas_path_in_several_weight_chunks(op):
    # dequantized_linear decodes at most 8 MB of fp32 weight rows (3640 at K = 576) per GEMM
    qweight, weight = quantized_weight(Q.Q8_0, 4000, 576, seed=5)
    check(op, torch.randn(PANEL_MAX_ROWS + 3, 576), qweight, weight, Q.Q8_0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_prefill_row_counts(op, fmt):
    # a prefill chunk: the panel GEMM (or, on an Intel CPU, BLAS) over several of its ~1 MB
    # m-blocks of x, with a partial 32-row tile at the end
    qweight, weight = quantized_weight(fmt, 100, 576, seed=6)
    check(op, torch.randn(1000, 576), qweight, weight, fmt)


@pytest.mark.parametrize("n,k", [(67, 576), (130, 1536)])
def test_f32_weights(op, n, k):
    # an fp32 weight's own bytes as F32 "blocks" (the unquantized CPU linears on some CPUs)
    weight = torch.randn(n, k)
    for m in ROW_COUNTS + [1000]:
        check(op, torch.randn(m, k), weight.view(torch.uint8), weight, Q.F32)


def test_linear_module_on_the_f32_kernel(op):
    from hybridllm.layers.linear import Linear
    from hybridllm.layers.vocab_embedding import LMHead, VocabEmbedding

    linear = Linear(64, (96, 32), bias=True, dtype=torch.float32, device=torch.device("cpu"))
    linear.weight.copy_(torch.randn(128, 64))
    linear.bias.copy_(torch.randn(128))
    x = torch.randn(5, 3, 64)
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    linear.use_f32_kernel()
    assert linear.ggml_type == Q.F32 and linear.qweight.data_ptr() == linear.weight.data_ptr()
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)

    embedding = VocabEmbedding(100, 64, torch.float32, torch.device("cpu"))
    embedding.weight.copy_(torch.randn(100, 64))
    head = LMHead(100, 64, torch.float32, torch.device("cpu"), tied_to=embedding)
    h = torch.randn(4, 64)
    expected = h @ embedding.weight.T
    head.use_f32_kernel()
    assert head.qweight.data_ptr() == embedding.weight.data_ptr()  # no second copy of the table
    torch.testing.assert_close(head(h), expected, rtol=1e-5, atol=1e-5)

    odd = Linear(48, 8, bias=False, dtype=torch.float32, device=torch.device("cpu"))
    odd.use_f32_kernel()  # rows of 48 floats are not whole blocks: stays on F.linear
    assert odd.qweight is None


@pytest.mark.parametrize("m", [1, 64])
def test_single_output_feature(op, m):
    qweight, weight = quantized_weight(Q.Q4_0, 1, 32, seed=4)
    check(op, torch.randn(m, 32), qweight, weight, Q.Q4_0)


def test_strided_and_unaligned_x(op):
    qweight, weight = quantized_weight(Q.Q8_0, 48, 96, seed=3)
    base = torch.randn(96, 40)
    check(op, base.T, qweight, weight, Q.Q8_0)  # [40, 96] transposed view
    check(op, base.T[3:4], qweight, weight, Q.Q8_0)  # one row
    flat = torch.randn(1 + 96)
    check(op, flat[1:].view(1, 96), qweight, weight, Q.Q8_0)  # data not 64-byte aligned


def test_empty_shapes(op):
    qweight, _ = quantized_weight(Q.Q4_0, 16, 64)
    assert op(torch.randn(0, 64), qweight, int(Q.Q4_0), 16).shape == (0, 16)
    empty = torch.zeros(0, 64 // 32 * 18, dtype=torch.uint8)
    assert op(torch.randn(3, 64), empty, int(Q.Q4_0), 0).shape == (3, 0)


def test_rejects_bad_inputs(op):
    qweight, _ = quantized_weight(Q.Q4_1, 8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="not a multiple of the block size 32"):
        op(torch.randn(2, 48), qweight[:, :30].contiguous(), int(Q.Q4_1), 8)
    with pytest.raises(RuntimeError, match="qweight shape .* does not match"):
        op(x, qweight[:, :-1].contiguous(), int(Q.Q4_1), 8)  # wrong byte width
    with pytest.raises(RuntimeError, match="qweight shape .* does not match"):
        op(x, qweight, int(Q.Q4_1), 9)  # wrong out_features
    with pytest.raises(RuntimeError, match="qweight shape .* does not match"):
        op(x, qweight, int(Q.Q8_0), 8)  # bytes of another format
    with pytest.raises(RuntimeError, match="unsupported ggml_type 9"):
        op(x, qweight, int(Q.Q8_1), 8)
    with pytest.raises(RuntimeError, match="not a multiple of the block size 256"):
        op(x, qweight, int(Q.Q4_K), 8)  # Q4_K rows are 256-weight super-blocks
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(x.double(), qweight, int(Q.Q4_1), 8)
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        op(x[0], qweight, int(Q.Q4_1), 8)
    with pytest.raises(RuntimeError, match="qweight must be uint8"):
        op(x, qweight.to(torch.int8), int(Q.Q4_1), 8)
    with pytest.raises(RuntimeError, match="qweight must be contiguous"):
        op(x, torch.cat([qweight, qweight], 1)[:, :40], int(Q.Q4_1), 8)


@pytest.mark.parametrize("rows", [1, DIRECT_MAX_ROWS + 1, 300])
def test_under_inference_mode(op, rows):
    # The engine runs under inference_mode; the panel path writes its output from pool threads,
    # the BLAS path into views of it.
    qweight, weight = quantized_weight(Q.Q4_1, 1000, 64)
    with torch.inference_mode():
        check(op, torch.randn(rows, 64), qweight, weight, Q.Q4_1)
