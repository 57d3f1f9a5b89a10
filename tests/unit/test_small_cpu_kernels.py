"""The compiled hybridllm::silu_and_mul and hybridllm::argmax_rows against their torch forms."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hybridllm.layers.cpu_kernels import DISABLE_ENV, load_cpu_kernels
from hybridllm.layers.mlp import GatedMLP
from hybridllm.sample.sampler import Sampler

pytestmark = pytest.mark.skipif(os.environ.get(DISABLE_ENV) == "0", reason="kernels disabled")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not load_cpu_kernels():
        pytest.skip("native CPU kernels not buildable here")


@pytest.mark.parametrize("rows,width", [(1, 8), (3, 1536), (64, 1536), (7, 100)])
def test_silu_and_mul_matches_torch(rows, width):
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * width) * 6  # wide range: large positive and negative gates
    x[0, 0], x[0, 1] = 100.0, -100.0  # saturated gates
    gate, up = x.split(width, dim=-1)
    ref = F.silu(gate.double()) * up.double()
    out = torch.ops.hybridllm.silu_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_half_types(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 64).to(dtype)
    gate, up = x.float().split(32, dim=-1)
    out = torch.ops.hybridllm.silu_and_mul(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)


def test_silu_and_mul_rejects_bad_input():
    with pytest.raises(RuntimeError, match="last dim must be even"):
        torch.ops.hybridllm.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        torch.ops.hybridllm.silu_and_mul(torch.randn(8, 4).T)


def test_gated_mlp_native_matches_torch_path():
    torch.manual_seed(2)
    mlp = GatedMLP(32, 48, False, "silu", torch.float32, torch.device("cpu"))
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(6, 32)
    ref = mlp(x)
    mlp.use_native_op()
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 17), (64, 49152), (5, 1000), (3, 16)])
def test_argmax_rows_matches_torch(rows, n):
    torch.manual_seed(3)
    x = torch.randn(rows, n)
    assert torch.equal(torch.ops.hybridllm.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nans():
    x = torch.zeros(5, 40)
    x[0, [3, 19, 35]] = 2.0  # ties: first index, across lanes and the tail
    x[1, [33, 37]] = float("inf")
    x[2, :] = float("-inf")  # every value -inf: index 0, as torch
    x[3, [5, 30]] = float("nan")  # torch: the first NaN wins
    x[3, 2] = 1e30
    x[4, 39] = 1.0  # maximum in the tail after the 16-lane body
    assert torch.equal(torch.ops.hybridllm.argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(40, 6).T  # a non-contiguous view
    assert torch.equal(torch.ops.hybridllm.argmax_rows(strided), strided.argmax(dim=-1))


def test_sampler_native_argmax_matches():
    torch.manual_seed(4)
    logits = torch.randn(9, 3000)
    assert torch.equal(Sampler(native_argmax=True)._argmax(logits), logits.argmax(dim=-1))
