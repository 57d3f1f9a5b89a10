"""The compiled small CPU ops (silu_and_mul, argmax_rows, rotary_embedding_, write_kv_cache)
against their torch forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridllm.layers.mlp import GatedMLP
from hybridllm.layers.paged_attention_cpu import write_kv_cache
from hybridllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_
from hybridllm.sample.sampler import Sampler
from tests.kernel_helpers import require_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


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


def _rope(dtype, head_dim=64):
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    return RotaryEmbedding(head_dim, params, dtype, torch.device("cpu"))


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_embedding_matches_torch(tokens, head_dim):
    # q and k as the strided views of a fused qkv row that the attention layers rotate
    torch.manual_seed(tokens)
    heads, kv_heads = 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    angles = _rope(torch.float32, head_dim)(torch.randint(0, 5000, (tokens,)), 5000)
    ref, out = qkv.clone(), qkv.clone()
    width = (heads + kv_heads) * head_dim
    apply_rotary_(ref[:, :width].view(tokens, -1, head_dim), angles.cos, angles.sin_signed)
    torch.ops.hybridllm.rotary_embedding_(
        out[:, :width].view(tokens, -1, head_dim), angles.cos, angles.sin_signed
    )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, width:], qkv[:, width:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_embedding_half_types(dtype):
    # computed in fp32 and rounded once (torch's mul_ then addcmul_ rounds twice)
    torch.manual_seed(2)
    x = torch.randn(9, 3, 64).to(dtype)
    angles = _rope(dtype)(torch.arange(9) * 100, 1000)
    ref = x.float() * angles.cos.float()
    ref += torch.cat((x[..., 32:], x[..., :32]), dim=-1).float() * angles.sin_signed.float()
    out = x.clone()
    torch.ops.hybridllm.rotary_embedding_(out, angles.cos, angles.sin_signed)
    torch.testing.assert_close(out, ref.to(dtype), rtol=0, atol=0)


def test_rotary_angles_choose_the_native_op():
    rope = _rope(torch.float32)
    positions = torch.tensor([3, 70])
    assert not rope(positions, 100).native
    rope.use_native_op()
    angles = rope(positions, 100)
    assert angles.native
    x = torch.randn(2, 3, 64)
    ref = x.clone()
    apply_rotary_(ref, angles.cos, angles.sin_signed)
    angles.rotate_(x)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)


def test_rotary_embedding_rejects_bad_input():
    angles = _rope(torch.float32)(torch.arange(4), 10)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.hybridllm.rotary_embedding_(
            torch.zeros(4, 2, 64, dtype=torch.float64), angles.cos, angles.sin_signed
        )
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.hybridllm.rotary_embedding_(torch.zeros(3, 2, 64), angles.cos, angles.sin_signed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 700])
def test_write_kv_cache_matches_index_copy(dtype, tokens):
    torch.manual_seed(tokens)
    kv_heads, head_dim = 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim).to(dtype)
    key = qkv[:, 9 * 64 : 12 * 64].view(tokens, kv_heads, head_dim)  # strided views
    value = qkv[:, 12 * 64 :].view(tokens, kv_heads, head_dim)
    ref = torch.randn(2, 100, 16, kv_heads, head_dim).to(dtype)
    out = ref.clone()
    slots = torch.randperm(100 * 16)[:tokens]
    write_kv_cache(ref, key, value, slots)
    torch.ops.hybridllm.write_kv_cache(key, value, out, slots)
    assert torch.equal(out, ref)


def test_write_kv_cache_rejects_bad_slots_and_shapes():
    cache = torch.zeros(2, 4, 16, 2, 8)
    key = value = torch.ones(3, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.hybridllm.write_kv_cache(key, value, cache, torch.tensor([0, 64, 1]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.hybridllm.write_kv_cache(key, value, cache, torch.tensor([0, -1, 1]))
    with pytest.raises(RuntimeError, match="one row per"):
        torch.ops.hybridllm.write_kv_cache(key, value, cache, torch.tensor([0, 1]))
    assert not cache.any()  # nothing written before the checks failed
