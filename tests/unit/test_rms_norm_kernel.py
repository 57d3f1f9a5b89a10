"""The compiled CPU RMSNorm ops against F.rms_norm (and the module's fallback path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridllm.layers.norm import RMSNorm
from tests.kernel_helpers import require_cpu_kernels

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 576), (2, 3, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_unfused_torch(dtype, shape, with_residual):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5, dtype, torch.device("cpu"))
    norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
    x = torch.randn(shape, dtype=dtype) * 3
    residual = torch.randn(shape, dtype=dtype) if with_residual else None
    want = norm(x, residual)  # F.rms_norm path
    norm.use_native_op()
    with torch.inference_mode():
        got = norm(x, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum, rounded to dtype as `x + residual` is
        got, want = got[0], want[0]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_non_contiguous_input_takes_the_torch_path():
    norm = RMSNorm(64, 1e-6, torch.float32, torch.device("cpu"))
    norm.weight.fill_(1.0)
    norm.use_native_op()
    x = torch.randn(64, 8).T  # [8, 64], not contiguous
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6))


@pytest.mark.parametrize("tokens", [1, 5])
def test_per_head_views_into_a_wider_row_take_the_native_op(tokens):
    # Qwen3's q norm: [tokens, heads, D] heads of the fused qkv output, rows (tokens) wider than
    # heads * D; the output is a new contiguous tensor, the input untouched
    torch.manual_seed(tokens)
    norm = RMSNorm(64, 1e-6, torch.float32, torch.device("cpu"))
    norm.weight.copy_(torch.rand(64) + 0.5)
    qkv = torch.randn(tokens, 7 * 64)
    q = qkv[:, : 4 * 64].view(tokens, 4, 64)
    norm.use_native_op()
    got = norm(q)
    assert got.is_contiguous() and got.shape == (tokens, 4, 64)
    want = F.rms_norm(q.contiguous(), (64,), norm.weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, torch.ops.hybridllm.rms_norm(q.contiguous(), norm.weight, 1e-6))


def test_bad_inputs_name_the_problem():
    weight = torch.ones(64)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        torch.ops.hybridllm.rms_norm(torch.randn(4, 32), weight, 1e-6)
    with pytest.raises(RuntimeError, match="last dim dense"):
        torch.ops.hybridllm.rms_norm(torch.randn(64, 4).T, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="add_rms_norm: x must be contiguous"):
        torch.ops.hybridllm.add_rms_norm(
            torch.randn(8, 128)[:, :64], torch.randn(8, 64), weight, 1e-6
        )
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.hybridllm.add_rms_norm(torch.randn(4, 64), torch.randn(3, 64), weight, 1e-6)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.hybridllm.rms_norm(torch.randn(4, 64, dtype=torch.float64), weight, 1e-6)
