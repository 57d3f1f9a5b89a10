"""Paged attention (decode, prefill, chunked prefill with cached prefix) vs a dense reference."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hybridllm.layers.attention import PagedAttention, get_attention_backend
from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.paged_attention_cpu import TorchPagedAttention, write_kv_cache
from hybridllm.layers.paged_attention_cuda import (
    CudaPagedAttention,
    decode_num_splits,
    triton_available,
    triton_paged_decode,
    varlen_kwargs,
)
from hybridllm.layers.prepared_attention import prepare_attention
from tests.kernel_helpers import cpu_kernels_disabled, require_cpu_kernels
from tests.model_helpers import StepSequence, make_step, scattered_block_tables

NUM_BLOCKS = 64


def dense_reference(q, k_ctx, v_ctx, context_len, scale, window):
    """q [q_len, H, D] at the last q_len positions of a context k/v [ctx, kvh, D] (fp64)."""
    q_len, num_heads, _ = q.shape
    group = num_heads // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = v_ctx.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len - q_len, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [q_len, H, D]


def run_case(
    specs,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    block_size=4,
    window=None,
    dtype=torch.float32,
    backend=None,
    device="cpu",
    kv_dtype=None,
):
    """specs: list of (context_len, query_len); decodes (query_len 1) must come first.
    The attention runs on `device`, the fp64 reference on the CPU. With `kv_dtype` the cache
    holds that dtype, and keys and values are drawn representable in it, so that storing them
    loses nothing and the tolerance can stay the same."""
    torch.manual_seed(0)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in specs)
    num_blocks = max(NUM_BLOCKS, 2 * len(specs) * max_blocks)
    tables = scattered_block_tables(len(specs), max_blocks, num_blocks, seed=1)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype)
    seqs, contexts, queries = [], [], []
    for (ctx, q_len), table in zip(specs, tables):
        k_ctx, v_ctx = (
            torch.randn(ctx, num_kv_heads, head_dim).to(kv_dtype or dtype).to(dtype)
            for _ in range(2)
        )
        prefix = ctx - q_len
        if prefix:  # the cached prefix, written as an earlier step would have
            _, _, meta = make_step([StepSequence([0] * prefix, 0, table)], block_size)
            write_kv_cache(cache, k_ctx[:prefix], v_ctx[:prefix], meta.slot_mapping)
        seqs.append(StepSequence([0] * q_len, prefix, table))
        contexts.append((k_ctx, v_ctx))
        queries.append(torch.randn(q_len, num_heads, head_dim, dtype=dtype))
    _, _, meta = make_step(seqs, block_size, device)
    query = torch.cat(queries)
    key = torch.cat([k[ctx - q_len :] for (k, _), (ctx, q_len) in zip(contexts, specs)])
    value = torch.cat([v[ctx - q_len :] for (_, v), (ctx, q_len) in zip(contexts, specs)])
    layer = PagedAttention(
        num_heads, num_kv_heads, head_dim, torch.device(device), sliding_window=window
    )
    if backend is not None:
        layer.backend = backend
    on = [t.to(device) for t in (query, key, value, cache)]
    out = layer(*on, prepare_attention(meta)).cpu()
    assert out.shape == (len(query), num_heads * head_dim)
    out = out.view(-1, num_heads, head_dim)
    refs = [
        dense_reference(q, k, v, ctx, head_dim**-0.5, window)
        for q, (k, v), (ctx, _) in zip(queries, contexts, specs)
    ]
    return out, torch.cat(refs)


MIXED = [(9, 1), (17, 1), (3, 1), (20, 7), (11, 11), (1, 1)]
_KERNELS_DISABLED = cpu_kernels_disabled()


@pytest.fixture(params=["torch", "native"])
def cpu_backend(request):
    """Both CPU decode paths: gather + SDPA, and the compiled paged-decode op."""
    if request.param == "torch":
        return TorchPagedAttention(native_ops=False)
    require_cpu_kernels()
    return TorchPagedAttention(native_ops=True)


@pytest.mark.skipif(
    _KERNELS_DISABLED or shutil.which("c++") is None, reason="no C++ compiler or disabled"
)
def test_native_kernels_build_with_a_compiler():
    assert load_cpu_kernels(), "a C++ compiler is present, so the CPU kernels must build"
    assert type(get_attention_backend(torch.device("cpu"))) is TorchPagedAttention
    assert get_attention_backend(torch.device("cpu")).native_ops


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([(13, 1)], id="one-decode"),
        pytest.param([(13, 1), (5, 1), (32, 1)], id="decode-batch"),
        # enough sequences for the native op's whole-sequence work items (>= 2 per thread)
        pytest.param([(c, 1) for c in (13, 5, 32, 1, 40, 7, 16, 17, 2, 29)], id="decode-batch-10"),
        pytest.param([(18, 18)], id="prefill"),
        pytest.param([(18, 5)], id="chunk-with-prefix"),
        pytest.param(MIXED, id="mixed"),
    ],
)
@pytest.mark.parametrize("window", [None, 6])
def test_matches_dense_reference(specs, window, cpu_backend):
    out, ref = run_case(specs, window=window, backend=cpu_backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes_and_mha(block_size, cpu_backend):
    out, ref = run_case(
        MIXED, num_heads=4, num_kv_heads=4, block_size=block_size, backend=cpu_backend
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, cpu_backend):
    out, ref = run_case(MIXED, dtype=dtype, backend=cpu_backend)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("window", [None, 6])
def test_16_bit_cache_under_fp32(kv_dtype, head_dim, window, cpu_backend):
    # kv_cache_dtype: fp32 queries over a float16/bfloat16 cache, widened as read (head_dim 64
    # and 128 take the native op's AVX-512 path, 32 its generic loop); decodes in batches of
    # ten (whole-sequence items) and three (per-head), prefills with and without a prefix
    decodes = [(c, 1) for c in (13, 5, 32, 1, 40, 7, 16, 17, 2, 29)]
    for specs in (decodes, decodes[:3], MIXED):
        out, ref = run_case(
            specs,
            num_heads=9,
            num_kv_heads=3,
            head_dim=head_dim,
            window=window,
            backend=cpu_backend,
            kv_dtype=kv_dtype,
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_16_bit_cache_write_rounds_like_torch(kv_dtype):
    # fp32 keys/values into a 16-bit cache: each slot holds tensor.to(kv_dtype), native op and
    # torch fallback alike; strided views (the qkv output's) as the model passes them
    require_cpu_kernels()
    torch.manual_seed(0)
    qkv = torch.randn(5, 3, 2, 16) * 100  # [tokens, k/v/other, heads, D]
    key, value = qkv[:, 0], qkv[:, 1]
    slots = torch.tensor([7, 0, 12, 3, 9])
    for write in (write_kv_cache, torch.ops.hybridllm.write_kv_cache):
        cache = torch.zeros(2, 4, 4, 2, 16, dtype=kv_dtype)
        if write is write_kv_cache:
            write(cache, key, value, slots)
        else:
            write(key, value, cache, slots)
        flat = cache.view(2, 16, 2, 16)
        assert torch.equal(flat[0, slots], key.to(kv_dtype))
        assert torch.equal(flat[1, slots], value.to(kv_dtype))
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots] = False
        assert not flat[:, untouched].any()


def test_long_decode_contexts(cpu_backend):
    # contexts of several hundred blocks, plus a 1-token one, in one decode batch
    specs = [(1000, 1), (1, 1), (517, 1)]
    out, ref = run_case(specs, head_dim=64, block_size=16, backend=cpu_backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (10, 2), (12, 2), (4, 4), (16, 2)])
@pytest.mark.parametrize("window", [None, 6])
def test_register_blocked_decode_head_dims(head_dim, num_heads, num_kv_heads, window, cpu_backend):
    # the native op's AVX-512 path for head_dim 64/128/256 (256: values in slices of 64
    # columns): query groups of 3, 5, 6 and 8 (more rows than one register pass holds) and 1;
    # ten sequences for whole-sequence items, three for
    # per-head ones
    specs = [(c, 1) for c in (13, 5, 32, 1, 40, 7, 16, 17, 2, 29)]
    for batch in (specs, specs[:3]):
        out, ref = run_case(
            batch,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            window=window,
            backend=cpu_backend,
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 6, 64])
def test_native_decode_of_a_verify_steps_rows_equals_them_one_by_one(head_dim, kv_dtype, window):
    # Speculative decoding's verify step: one sequence's consecutive positions as decode rows
    # with one block table. The native op reads them as one item (each row's later tokens
    # masked, runs halved for the threads); the result must be each row's alone, whatever the
    # batch around them (another sequence before and after, a run of 5 and one of 2).
    require_cpu_kernels()
    torch.manual_seed(0)
    num_heads, num_kv_heads, block_size, context = 9, 3, 4, 37
    num_blocks = 40
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype)
    verify = torch.randperm(num_blocks)[:12].to(torch.int32)
    other = torch.randperm(num_blocks)[:12].to(torch.int32)
    second = torch.randperm(num_blocks)[:12].to(torch.int32)
    tables = torch.stack([other] + [verify] * 5 + [second] * 2 + [other])
    lens = [context] + [context - 4 + i for i in range(5)] + [20, 21] + [context - 1]
    lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim)
    op = torch.ops.hybridllm.paged_decode_attention
    together = op(query, kv, tables, lens, 0.125, window, 0.0, None)
    alone = torch.cat(
        [
            op(query[i : i + 1], kv, tables[i : i + 1], lens[i : i + 1], 0.125, window, 0.0, None)
            for i in range(len(lens))
        ]
    )
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-6)


def test_native_op_rejects_bad_inputs():
    require_cpu_kernels()
    op = torch.ops.hybridllm.paged_decode_attention
    q = torch.randn(2, 4, 8)
    cache = torch.zeros(2, 4, 4, 2, 8)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        op(q, cache, tables.long(), lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(q.double(), cache, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="dtypes differ"):  # 16-bit caches: fp32 queries only
        op(q.bfloat16(), cache.half(), tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="dtypes differ"):  # wider than the query
        op(q.half(), cache, tables, lens, 1.0, 0)
    write = torch.ops.hybridllm.write_kv_cache
    key, slots = torch.randn(2, 2, 8), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="must have kv_cache's dtype"):
        write(key.double(), key.double(), cache.half(), slots)
    with pytest.raises(RuntimeError, match="must have kv_cache's dtype"):
        write(key.half(), key.half(), cache, slots)
    with pytest.raises(RuntimeError, match=r"key \(Float\) and value \(Half\) dtypes differ"):
        write(key, key.half(), cache.half(), slots)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(torch.randn(2, 3, 8), cache, tables, lens, 1.0, 0)


def test_cuda_backend_falls_back_without_triton():
    # the CUDA backend must import and compute on any machine (torch path without triton)
    backend = CudaPagedAttention(use_triton=False)
    out, ref = run_case(MIXED, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert isinstance(get_attention_backend(torch.device("cuda")), CudaPagedAttention)


# the kernels also run on CPU tensors under triton's interpreter (TRITON_INTERPRET=1; triton >= 3.9
# with numpy >= 2.4, whose scalar conversion the 3.6 interpreter trips on)
_TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CAN_RUN_TRITON = triton_available() and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)


@pytest.mark.skipif(not _CAN_RUN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window", [None, 6])
def test_triton_decode_matches_torch(window):
    torch.manual_seed(0)
    device = _TRITON_DEVICE
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    specs = [(13, 1), (40, 1), (1, 1)]
    tables = scattered_block_tables(len(specs), 3, NUM_BLOCKS)
    cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim, device=device)
    _, _, meta = make_step(
        [StepSequence([0], ctx - 1, t) for (ctx, _), t in zip(specs, tables)], block_size, device
    )
    prep = prepare_attention(meta)
    query = torch.randn(len(specs), num_heads, head_dim, device=device)
    scale = head_dim**-0.5
    expected = TorchPagedAttention().decode(query, cache, prep, scale, window)
    actual = CudaPagedAttention(use_triton=True).decode(query, cache, prep, scale, window)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def split_decode_case(specs, dtype=torch.float32, num_kv_heads=2, head_dim=64, block_size=16):
    """(query, cache, prep) of a decode batch with contexts `specs` on the Triton device."""
    torch.manual_seed(0)
    device = _TRITON_DEVICE
    max_blocks = max(-(-ctx // block_size) for ctx in specs)
    num_blocks = len(specs) * max_blocks + 4
    tables = scattered_block_tables(len(specs), max_blocks, num_blocks, seed=2)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, device=device).to(dtype)
    steps = [StepSequence([0], ctx - 1, t) for ctx, t in zip(specs, tables)]
    _, _, meta = make_step(steps, block_size, device)
    query = torch.randn(len(specs), 4 * num_kv_heads, head_dim, device=device).to(dtype)
    return query, cache, prepare_attention(meta)


@pytest.mark.skipif(not _CAN_RUN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window", [None, 6, 100])
@pytest.mark.parametrize("splits, per_split", [(3, 21), (7, 9), (64, 1)])
def test_triton_split_decode_matches_torch(window, splits, per_split):
    # odd context lengths, 63 blocks at most: ranges end mid-sequence, and the shorter
    # sequences (and a window's far ranges) leave whole ranges empty
    query, cache, prep = split_decode_case([1000, 1, 517, 33])
    scale = 0.125
    expected = TorchPagedAttention().decode(query, cache, prep, scale, window)
    actual = triton_paged_decode(
        query, cache, prep.decode_block_tables, prep.decode_seq_lens, scale, window,
        splits, per_split,
    )  # fmt: skip
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not _CAN_RUN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_splits_a_long_context_at_batch_one(dtype):
    # one sequence x 2 kv heads on 132 SMs: the backend chooses 3 ranges of 21 blocks itself
    query, cache, prep = split_decode_case([1001], dtype=dtype)
    assert decode_num_splits(1, 2, 1001, 16, 132) == (3, 21)
    expected = TorchPagedAttention().decode(query.float(), cache.float(), prep, 0.125, None)
    actual = CudaPagedAttention(use_triton=True, num_sms=132).decode(
        query, cache, prep, 0.125, None
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


def test_decode_splits_only_when_programs_leave_sms_idle():
    # an 8B model at batch 1: 8 programs on 132 SMs; 8k tokens -> 32 ranges of 16 blocks
    assert decode_num_splits(1, 8, 8192, 16, 132) == (32, 16)
    # enough (sequence, kv head) programs already, or a context too short to be worth it
    assert decode_num_splits(64, 8, 8192, 16, 132) == (1, 0)
    assert decode_num_splits(1, 8, 300, 16, 132) == (1, 0)
    # ranges of whole blocks covering the context exactly once, never more than SPLIT_MAX
    for batch, heads, ctx, bs in [(1, 8, 1_000_003, 16), (2, 2, 4097, 16), (3, 1, 777, 1)]:
        splits, per = decode_num_splits(batch, heads, ctx, bs, 132)
        blocks = -(-ctx // bs)
        assert 2 <= splits <= 64 and (splits - 1) * per < blocks <= splits * per


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """flash-attention's varlen semantics in fp64: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    against its keys k[cu_k[i]:cu_k[i+1]], the last query aligned with the last key; a query
    at aligned position p sees keys in [p - left, p + right] (-1: unbounded)."""
    assert q.shape[1] == k.shape[1] or enable_gqa
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        assert qe - qs <= max_q and ke - ks <= max_k
        kk = k[ks:ke].double().repeat_interleave(group, dim=1)
        vv = v[ks:ke].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), kk) * scale
        q_pos = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
        k_pos = torch.arange(ke - ks)[None, :]
        left, right = window_size
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if left >= 0:
            allowed &= k_pos >= q_pos - left
        if right >= 0:
            allowed &= k_pos <= q_pos + right
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out


class CountingVarlen:
    """reference_varlen that remembers the key rows it was given per call."""

    def __init__(self):
        self.key_rows = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
        self.key_rows.append(k.shape[0])
        return reference_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
            enable_gqa=enable_gqa,
        )  # fmt: skip


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([(18, 18)], id="prefill"),
        pytest.param([(18, 18), (7, 7), (30, 30)], id="prefills"),
        pytest.param([(18, 5)], id="chunk-with-prefix"),
        pytest.param([(20, 7), (11, 11), (33, 1 + 2), (25, 25)], id="chunks-and-prefills"),
        pytest.param(MIXED, id="mixed"),
    ],
)
@pytest.mark.parametrize("window", [None, 6, 15])
def test_varlen_prefill_matches_dense_reference(specs, window):
    # every prefill of the step in one call per layer; prefix-cached chunks read the cache
    varlen = CountingVarlen()
    backend = CudaPagedAttention(use_triton=False, varlen_fn=varlen)
    out, ref = run_case(specs, window=window, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    num_decodes = next((i for i, (_, q) in enumerate(specs) if q != 1), len(specs))
    prefills = specs[num_decodes:]
    if all(ctx == q for ctx, q in prefills):
        # no cached prefix: the step's own rows are the keys, nothing is gathered
        expected = sum(q for _, q in prefills)
    else:
        # each context from the first key its chunk's window shows it
        expected = sum(
            ctx - (0 if window is None else max(0, ctx - q - window + 1)) for ctx, q in prefills
        )
    assert varlen.key_rows == [expected]


def test_varlen_prefill_gathers_only_the_window():
    # a 5-token chunk of a 40-token context with a window of 6 needs keys 30..39 only
    varlen = CountingVarlen()
    backend = CudaPagedAttention(use_triton=False, varlen_fn=varlen)
    out, ref = run_case([(40, 5)], window=6, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert varlen.key_rows == [5 + 6 - 1]
    out, ref = run_case([(40, 5)], window=None, backend=CudaPagedAttention(False, None, varlen))
    assert varlen.key_rows[-1] == 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_prefill_half_precision(dtype):
    backend = CudaPagedAttention(use_triton=False, varlen_fn=reference_varlen)
    out, ref = run_case(MIXED, dtype=dtype, window=6, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_varlen_kwargs_follow_the_torch_release():
    new = {"scale", "window_size", "enable_gqa"}
    assert varlen_kwargs(new, 0.1, 64, None, True) == dict(
        scale=0.1, window_size=(-1, 0), enable_gqa=True
    )
    assert varlen_kwargs(new, 0.1, 64, 6, False) == dict(scale=0.1, window_size=(5, 0))
    # torch 2.10: causal only, no scale argument: the default scale, no window
    old = {"is_causal"}
    assert varlen_kwargs(old, 64**-0.5, 64, None, True) == dict(is_causal=True)
    assert varlen_kwargs(old, 64**-0.5, 64, 6, True) is None
    assert varlen_kwargs(old, 0.1, 64, None, False) is None


def test_cuda_backend_without_varlen_on_cpu_tensors_runs_sdpa_per_sequence():
    # no varlen_fn given: CPU tensors (and fp32, and pre-sm80 GPUs) take the SDPA fallback
    backend = CudaPagedAttention(use_triton=False)
    out, ref = run_case(MIXED, window=6, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert backend._varlen_fn is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 6])
def test_cuda_varlen_prefill_matches_dense_reference(window):
    # torch's own varlen flash kernel, with prefix-cached chunks and windows, in bf16
    pytest.importorskip("torch.nn.attention.varlen")
    backend = CudaPagedAttention()
    specs = [(9, 1), (40, 1), (20, 7), (11, 11), (300, 45), (64, 64)]
    out, ref = run_case(
        specs, head_dim=64, block_size=16, window=window, dtype=torch.bfloat16,
        backend=backend, device="cuda",
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert backend._varlen_fn is not None and not backend._varlen_failed


def test_rejects_bad_metadata():
    _, _, meta = make_step([StepSequence([1, 2], 0, [0])], 4)
    meta.seq_lens_cpu = [1]  # shorter than the query
    with pytest.raises(ValueError, match="shorter than its query"):
        prepare_attention(meta)
    _, _, meta = make_step([StepSequence([1, 2], 3, [0, 1])], 4)
    meta.num_decodes = 1  # a "decode" row with two tokens
    with pytest.raises(ValueError, match="one query token"):
        prepare_attention(meta)
