"""The native hybridllm::mla_decode_attention op (DeepSeek MLA decode, absorbed form: every
query head attends over the shared latent rows [c_kv | k_pe]) against a float64 torch form."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import require_cpu_kernels


@pytest.fixture(scope="module")
def op():
    require_cpu_kernels()
    return torch.ops.hybridllm.mla_decode_attention


def paged_case(lens, heads, latent, rope, block_size, dtype, seed=0, spare_rows=1):
    """Random queries and a latent cache holding each sequence's rows in shuffled blocks.

    Returns (query, kv_cache, block_tables, seq_lens); the tables and seq_lens have spare_rows
    rows past the batch, and every table entry past a sequence's blocks is -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    dim = latent + rope
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns
    max_blocks = max(needed + [1]) + 2
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(lens) + spare_rows, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[used : used + n]
        used += n
    cache = torch.randn(num_blocks, block_size, dim, generator=g).to(dtype)
    query = torch.randn(len(lens), heads, dim, generator=g)
    seq_lens = torch.tensor(list(lens) + [0] * spare_rows, dtype=torch.int32)
    return query, cache, tables, seq_lens


def reference(query, cache, tables, seq_lens, scale, latent):
    """out[b, h] = softmax_t(scale q . row_t) @ row_t[:latent] over the gathered rows, in fp64."""
    block_size = cache.shape[1]
    out = torch.zeros(query.shape[0], query.shape[1], latent, dtype=torch.float64)
    for b in range(query.shape[0]):
        t = torch.arange(int(seq_lens[b]))
        if len(t) == 0:
            continue
        rows = cache[tables[b, t // block_size].long(), t % block_size].double()  # [n, D]
        p = torch.softmax(scale * query[b].double() @ rows.T, dim=-1)
        out[b] = p @ rows[:, :latent]
    return out


def check(op, lens, heads, latent, rope, block_size, dtype, seed=0):
    query, cache, tables, seq_lens = paged_case(lens, heads, latent, rope, block_size, dtype, seed)
    scale = 2.0 / (latent + rope) ** 0.5  # peakier than 1 / sqrt(D): a less even softmax
    out = op(query, cache, tables, seq_lens, scale, latent)
    assert out.shape == (len(lens), heads, latent) and out.dtype == torch.float32
    ref = reference(query, cache, tables, seq_lens, scale, latent)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("latent,rope", [(512, 64), (32, 16)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_torch(op, dtype, heads, latent, rope, block_size):
    bs = block_size
    # batch 1: one token, a partial last block, several whole blocks; batch 3: mixed lengths
    for seed, lens in enumerate([[1], [3 * bs + 5], [4 * bs], [1, 2 * bs + 7, 5 * bs]]):
        check(op, lens, heads, latent, rope, block_size, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_long_contexts_split_across_threads(op, dtype, threads):
    # batch 1 and 3 under few threads split each context into key ranges merged at the end
    # (flash-decoding); lengths off the 32-key tiles and the ranges' boundaries
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(op, [1000], 128, 512, 64, 16, dtype, seed=1)
        check(op, [77, 613, 1], 16, 32, 16, 32, dtype, seed=2)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("latent,rope", [(24, 8), (40, 9)])
def test_widths_off_the_vector_length(op, latent, rope):
    # widths that are not multiples of 16 take the scalar path
    for dtype in DTYPES:
        check(op, [70, 1, 33], 5, latent, rope, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_cache_view_with_padded_rows(op, dtype):
    # rows of a wider tensor: the last dim dense, the row and block strides the view's own
    query, cache, tables, seq_lens = paged_case([50, 9], 16, 64, 16, 16, dtype)
    wide = torch.zeros(*cache.shape[:2], 96, dtype=dtype)
    wide[..., :80] = cache
    out = op(query, wide[..., :80], tables, seq_lens, 0.1, 64)
    ref = reference(query, cache, tables, seq_lens, 0.1, 64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


def test_an_empty_sequence_gives_zeros(op):
    query, cache, tables, seq_lens = paged_case([5, 0, 40], 16, 32, 16, 16, torch.float32)
    out = op(query, cache, tables, seq_lens, 0.1, 32)
    assert torch.equal(out[1], torch.zeros(16, 32))
    assert torch.equal(op(query, cache, tables, seq_lens * 0, 0.1, 32), torch.zeros(3, 16, 32))
    torch.testing.assert_close(
        out.double(), reference(query, cache, tables, seq_lens, 0.1, 32), rtol=1e-4, atol=2e-5
    )


def test_rejects_bad_inputs(op):
    query, cache, tables, lens = paged_case([20, 3], 4, 32, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"query must be a contiguous float32 \[B, H, D\]"):
        op(query[0], cache, tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="query must be a contiguous float32"):
        op(query.bfloat16(), cache, tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="query must be a contiguous float32"):
        op(query.transpose(0, 1), cache, tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match=r"kv_cache must be \[num_blocks, block_size, D\]"):
        op(query, cache.unsqueeze(0), tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="kv_cache dtype must be float32, float16 or bfloat16"):
        op(query, cache.double(), tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="differs from kv_cache's row width"):
        op(query, cache[..., :40], tables, lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="latent_dim"):
        op(query, cache, tables, lens, 1.0, 49)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        op(query, cache, tables.long(), lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        op(query, cache, tables[:1], lens, 1.0, 32)
    with pytest.raises(RuntimeError, match="seq_lens must be a contiguous int32"):
        op(query, cache, tables, lens.long(), 1.0, 32)
    too_long = lens.clone()
    too_long[1] = tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = \d+ is negative or beyond the"):
        op(query, cache, tables, too_long, 1.0, 32)
    unowned = lens.clone()
    unowned[1] = 17  # the second block of sequence 1 is -1 in its table
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 1\] = -1 is not a block"):
        op(query, cache, tables, unowned, 1.0, 32)
