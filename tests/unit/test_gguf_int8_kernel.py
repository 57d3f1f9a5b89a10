"""hybridllm::gguf_linear with int8 activations: every block type on every integer path."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridllm.layers import gguf_linear as gguf_linear_module
from tests.kernel_helpers import require_cpu_kernels
from tests.unit.test_gguf_linear_kernel import quantized_weight, random_blocks

Q = GGMLQuantizationType
PER_32 = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# The op's `activations` values of the integer paths (gguf_q8_linear.h); 1 is the best one built.
PATH_NAMES = {2: "avx512-vnni", 3: "avx2-vnni", 4: "avx2-maddubs", 5: "scalar"}
GEMM_MIN_ROWS = 8  # kQ8GemmMinRows: from here paths 1-2 take the int8 GEMM, 3-5 never do
# rows of x: 1-2 take 4 weight rows a call, 3-5 fill a path's row tile, 6 leaves a partial
# one; from 8 the GEMM: 8 and 16 in one 16-row tile, 17 and 33 leave a partial 32-row
# tile, 70 three tiles (the few-rows kernels of paths 3-5 at every count)
ROW_COUNTS = [1, 2, 3, 4, 5, 6, GEMM_MIN_ROWS, 9, 16, 17, 24, 33, 70]


@pytest.fixture(scope="module")
def op():
    require_cpu_kernels()
    return torch.ops.hybridllm.gguf_linear


def built_paths() -> list[int]:
    require_cpu_kernels()
    return list(torch.ops.hybridllm.gguf_int8_paths())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def group_of(fmt) -> int:
    """x's int8 group for weights of `fmt` (q8_group): a super-block of 256 or a block of 32."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(fmt)][0]


def quantize_x(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's int8 activations, rebuilt: (x as the op sees it, each group's scale per value).
    d = max|x| / 127 per group, q = round-half-even(x * (1 / d)), all in fp32 as the op does."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inverse)
    assert q.abs().max() <= 127
    return (q * d).reshape(m, k), d.expand_as(g).reshape(m, k)


def check_int8(op, x, qweight, weight, fmt, path):
    y = op(x, qweight, int(fmt), weight.shape[0], path)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], weight.shape[0])
    xq, d = quantize_x(x, group_of(fmt))
    w = weight.double()
    # 1) the integer arithmetic is exact: against fp64 on the quantized x, fp32 rounding only
    ref = xq.double() @ w.T
    bound = 1e-5 * (xq.double().abs() @ w.abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"path {path}: max error {err.max():.3g} vs the quantized x"
    # 2) the stated tolerance against fp32 x: each value off by at most half its group's step
    exact = x.double() @ w.T
    tolerance = (d.double() / 2) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((y.double() - exact).abs() <= tolerance).all()
    return y


@pytest.mark.parametrize("path", [1, 2, 3, 4, 5], ids=lambda p: PATH_NAMES.get(p, "best"))
@pytest.mark.parametrize("fmt", PER_32 + K_QUANTS, ids=lambda f: f.name)
def test_every_type_on_every_path(op, fmt, path):
    if path != 1 and path not in built_paths():
        pytest.skip(f"this build has no {PATH_NAMES[path]} path")
    # random bytes: every nibble / int8 / 6-bit pattern, scales and mins of either sign
    # weight rows: partial micro-kernels (4 to 12 rows a call); 100 x 2560 spans three GEMM panels
    shapes = [(37, 256), (67, 512), (29, 2560), (100, 2560)]
    if fmt in PER_32:
        shapes += [(37, 32), (13, 96), (21, 576)]  # 1, 3 (odd), 18 blocks a row
    for n, k in shapes:
        qweight, weight = random_blocks(fmt, n, k, seed=n)
        for m in ROW_COUNTS:
            check_int8(op, torch.randn(m, k), qweight, weight, fmt, path)


@pytest.mark.parametrize("fmt", PER_32, ids=lambda f: f.name)
def test_weights_from_gguf_quantizer(op, fmt):
    # real quantizer output (Q8_0 in [-127, 127], Q4_1 mins); each path against the reference
    # (they differ from each other by fp32 rounding only: the order of the block sums)
    qweight, weight = quantized_weight(fmt, 130, 1536, seed=7)
    x = torch.randn(3, 1536)
    for path in built_paths():
        check_int8(op, x, qweight, weight, fmt, path)


@pytest.mark.parametrize("fmt", [Q.Q4_1, Q.Q6_K], ids=lambda f: f.name)
def test_zero_groups_and_outliers(op, fmt):
    # a group of zeros has scale 0 (no division by it); an outlier coarsens only its own group
    qweight, weight = random_blocks(fmt, 40, 512, seed=3)
    x = torch.randn(4, 512)
    x[0] = 0
    x[1, :256] = 0
    x[2, 5] = 1e4
    x[3] *= 1e-30  # tiny but normal scales
    for path in built_paths():
        check_int8(op, x, qweight, weight, fmt, path)


@pytest.mark.parametrize("fmt", PER_32 + K_QUANTS, ids=lambda f: f.name)
def test_gemm_equals_the_few_rows_kernels(op, fmt):
    # the GEMM quantizes x as the few-rows kernels do and sums exactly: the same up to fp32
    # rounding (the scalar kernel, forced past the GEMM's row count, is the reference)
    if not {2, 4} & set(built_paths()):
        pytest.skip("no int8 GEMM in this build (it needs AVX512-VNNI or AVX2)")
    qweight, weight = random_blocks(fmt, 45, 512, seed=4)
    x = torch.randn(40, 512)
    gemm, scalar = (op(x, qweight, int(fmt), 45, path) for path in (1, 5))
    assert not torch.equal(gemm, op(x, qweight, int(fmt), 45, 0))  # not the fp32 path
    torch.testing.assert_close(gemm, scalar, rtol=1e-5, atol=1e-5 * scalar.abs().max().item())


def test_f32_weights_stay_fp32(op):
    w = torch.randn(50, 512)
    x = torch.randn(3, 512)
    f32 = int(Q.F32)
    assert torch.equal(op(x, w.view(torch.uint8), f32, 50, 1), op(x, w.view(torch.uint8), f32, 50))


def test_strided_x_and_bad_arguments(op):
    qweight, weight = quantized_weight(Q.Q8_0, 48, 96, seed=3)
    base = torch.randn(96, 40)
    check_int8(op, base.T[:5], qweight, weight, Q.Q8_0, 1)  # a transposed view
    with pytest.raises(RuntimeError, match="activations must be 0"):
        op(torch.randn(2, 96), qweight, int(Q.Q8_0), 48, 9)


def test_wrapper_default_from_the_environment(op, monkeypatch):
    qweight, weight = random_blocks(Q.Q5_K, 20, 256, seed=5)
    x = torch.randn(2, 256)
    try:
        monkeypatch.setenv(gguf_linear_module.ACTIVATIONS_ENV, "int8")
        gguf_linear_module.default_activations.cache_clear()
        int8 = gguf_linear_module.gguf_linear(x, qweight, int(Q.Q5_K), 20)
        assert torch.equal(int8, op(x, qweight, int(Q.Q5_K), 20, 1))
        monkeypatch.setenv(gguf_linear_module.ACTIVATIONS_ENV, "fp32")
        gguf_linear_module.default_activations.cache_clear()
        fp32 = gguf_linear_module.gguf_linear(x.view(1, 2, 256), qweight, int(Q.Q5_K), 20)
        assert torch.equal(fp32[0], op(x, qweight, int(Q.Q5_K), 20, 0))
        monkeypatch.setenv(gguf_linear_module.ACTIVATIONS_ENV, "int4")
        gguf_linear_module.default_activations.cache_clear()
        with pytest.raises(ValueError, match="HYBRIDLLM_GGUF_ACTIVATIONS: expected one of"):
            gguf_linear_module.gguf_linear(x, qweight, int(Q.Q5_K), 20)
    finally:
        monkeypatch.undo()
        gguf_linear_module.default_activations.cache_clear()
