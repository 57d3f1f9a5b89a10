"""`hybridllm::prefill_attention` (causal chunk over its context, GQA, windows, 16-bit caches)
against a float64 reference, and its input checks."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import require_cpu_kernels
from tests.unit.test_paged_attention import dense_reference


@pytest.fixture(autouse=True)
def _kernels():
    require_cpu_kernels()


# (query tokens, context, heads, kv heads, head_dim, window, cache dtype)
CASES = [
    (128, 128, 9, 3, 64, 0, torch.float32),  # SmolLM2's prompt: no prefix
    (37, 100, 8, 2, 128, 0, torch.float16),  # a chunk after a cached prefix, fp16 cache
    (50, 50, 6, 6, 40, 12, torch.float32),  # head_dim not a multiple of 16, a window
    (20, 70, 4, 2, 64, 30, torch.bfloat16),
    (1, 9, 4, 1, 64, 0, torch.float32),  # one query token
    (300, 300, 4, 1, 32, 0, torch.float32),  # tiles of more than 16 tokens
]


@pytest.mark.parametrize("n,ctx,heads,kv_heads,head_dim,window,dtype", CASES)
def test_matches_reference(n, ctx, heads, kv_heads, head_dim, window, dtype):
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    # the query as the model passes it: a strided view of the fused qkv projection's output
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=g)
    query = qkv[:, :heads]
    key = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = torch.ops.hybridllm.prefill_attention(query, key, value, scale, window)
    ref = dense_reference(query, key.float(), value.float(), ctx, scale, window or None)
    assert out.shape == (n, heads, head_dim)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=1e-5)


def test_rejects_bad_inputs():
    q, kv = torch.randn(4, 6, 64), torch.randn(8, 2, 64)
    op = torch.ops.hybridllm.prefill_attention
    with pytest.raises(RuntimeError, match="query must be float32"):
        op(q.double(), kv, kv, 1.0, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, kv, kv.half(), 1.0, 0)
    with pytest.raises(RuntimeError, match="not a multiple of"):
        op(torch.randn(4, 5, 64), kv, kv, 1.0, 0)
    with pytest.raises(RuntimeError, match="queries but a context of"):
        op(torch.randn(9, 6, 64), kv, kv, 1.0, 0)
    with pytest.raises(RuntimeError, match="head_dim differs"):
        op(torch.randn(4, 6, 32), kv, kv, 1.0, 0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        op(q, kv, kv, 1.0, -1)
    with pytest.raises(RuntimeError, match="dense"):
        op(q, kv.transpose(0, 2).contiguous().transpose(0, 2), kv, 1.0, 0)
