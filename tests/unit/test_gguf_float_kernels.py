"""F16 and BF16 weights computed from their own bytes by the native ops (half of fp32's bytes):
every row count's path, int8 activations asked for or not, equals fp32 arithmetic on the
widened weights; decoding is exact."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.kernel_helpers import require_cpu_kernels

Q = GGMLQuantizationType
DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# 1-24: the few-rows kernels (tiles of 1-5 rows); 25 and more: the panel GEMM / BLAS paths
ROWS = [1, 2, 3, 4, 5, 7, 8, 24, 25, 33, 129]


@pytest.fixture(scope="module")
def ops():
    require_cpu_kernels()
    return torch.ops.hybridllm


def float_weight(fmt: Q, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight's bytes [rows, 2 k] uint8, the weight widened to fp32 [rows, k])."""
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(DTYPES[fmt])
    w[0, :5] = torch.tensor([0.0, -0.0, 65504.0 if fmt == Q.F16 else 3e38, 1e-7, -2.5])
    return w.view(torch.uint8), w.float()


@pytest.mark.parametrize("fmt", list(DTYPES), ids=lambda f: f.name)
def test_decoding_is_exact(ops, fmt):
    blocks, want = float_weight(fmt, 37, 1056, 0)
    got = ops.gguf_dequantize(blocks, int(fmt), 1056)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("activations", [0, 1], ids=["fp32", "int8 asked"])
@pytest.mark.parametrize("fmt", list(DTYPES), ids=lambda f: f.name)
def test_linear_is_fp32_arithmetic_on_the_widened_weights(ops, fmt, activations):
    blocks, w = float_weight(fmt, 45, 512, 1)
    w[0] = 0  # the extreme values above would swamp the tolerance
    blocks = w.to(DTYPES[fmt]).view(torch.uint8)
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        got = ops.gguf_linear(x, blocks, int(fmt), 45, activations)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"{rows} rows")


@pytest.mark.parametrize("fmt", list(DTYPES), ids=lambda f: f.name)
def test_the_head_linear_takes_them(ops, fmt):
    # per-head matrices [H, out, bytes]
    heads = [float_weight(fmt, 24, 64, seed) for seed in range(3)]
    blocks = torch.stack([b for b, _ in heads])
    x = torch.randn(5, 3, 64)
    got = ops.gguf_head_linear(x, blocks, int(fmt), 24, 1)
    want = torch.stack([x[:, h] @ heads[h][1].T for h in range(3)], dim=1)
    # row 0 of each head holds huge values: compare the others
    torch.testing.assert_close(got[..., 1:], want[..., 1:], rtol=1e-5, atol=1e-4)
