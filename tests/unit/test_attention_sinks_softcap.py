"""Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) in the paged attention backends,
against an fp64 eager reference that is itself checked against transformers' own
`eager_attention_forward` of both models."""

from __future__ import annotations

import pytest
import torch

from hybridllm.layers import paged_attention_cpu
from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.paged_attention_cpu import TorchPagedAttention, write_kv_cache
from hybridllm.layers.paged_attention_cuda import CudaPagedAttention, triton_paged_decode
from hybridllm.layers.prepared_attention import prepare_attention
from tests.kernel_helpers import require_cpu_kernels
from tests.model_helpers import StepSequence, make_step, scattered_block_tables
from tests.unit.test_paged_attention import (
    _CAN_RUN_TRITON,
    _TRITON_DEVICE,
    dense_reference,
    split_decode_case,
)

NUM_BLOCKS = 64
CAP = 4.0  # small enough that tanh bends the (scaled-up) scores of these tests
QUERY_GAIN = 3.0  # queries drawn 3x larger: scores of several units, where the cap bites


def reference(q, k_ctx, v_ctx, context_len, scale, window, softcap, sinks):
    """q [q_len, H, D] at the last q_len positions of a context k/v [ctx, kvh, D], in fp64:
    scores q.k * scale, soft-capped, masked (causal, windowed), softmax over the keys and the
    head's sink logit, the sink's column dropped."""
    q_len, num_heads, _ = q.shape
    group = num_heads // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = v_ctx.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(context_len - q_len, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [q_len, H, D]


def run_case(
    specs,
    softcap,
    has_sinks,
    backend,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    block_size=4,
    window=None,
    dtype=torch.float32,
    kv_dtype=None,
    device="cpu",
):
    """specs: (context_len, query_len) per sequence, decodes (query_len 1) first; the layer's
    output [tokens, H, D] and the fp64 reference's."""
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
        queries.append((QUERY_GAIN * torch.randn(q_len, num_heads, head_dim)).to(dtype))
    _, _, meta = make_step(seqs, block_size, device)
    query = torch.cat(queries)
    key = torch.cat([k[ctx - q_len :] for (k, _), (ctx, q_len) in zip(contexts, specs)])
    value = torch.cat([v[ctx - q_len :] for (_, v), (ctx, q_len) in zip(contexts, specs)])
    layer = PagedAttention(
        num_heads,
        num_kv_heads,
        head_dim,
        torch.device(device),
        sliding_window=window,
        logit_softcap=softcap,
        has_sinks=has_sinks,
    )
    sinks = None
    if has_sinks:
        # as the weight loader would: fp32 logits of the order of the scores
        sinks = 2.0 * torch.randn(num_heads) + 1.0
        layer.sinks.data.copy_(sinks)
    layer.backend = backend
    on = [t.to(device) for t in (query, key, value, cache)]
    out = layer(*on, prepare_attention(meta)).cpu()
    assert out.shape == (len(query), num_heads * head_dim)
    scale = head_dim**-0.5
    refs = [
        reference(q, k, v, ctx, scale, window, softcap, sinks)
        for q, (k, v), (ctx, _) in zip(queries, contexts, specs)
    ]
    return out.view(-1, num_heads, head_dim), torch.cat(refs)


SPECS = [
    # decode rows of different lengths (one shorter than the window, one of a single token)
    pytest.param([(13, 1), (5, 1), (32, 1), (1, 1)], id="decode-batch"),
    pytest.param([(13, 1)], id="one-decode"),  # the torch path slices instead of masking
    pytest.param([(18, 18)], id="prefill"),
    pytest.param([(20, 7)], id="chunk-with-prefix"),
    pytest.param([(9, 1), (17, 1), (20, 7), (11, 11), (1, 1)], id="mixed"),
]
FEATURES = [
    pytest.param(CAP, False, id="softcap"),
    pytest.param(None, True, id="sinks"),
    pytest.param(CAP, True, id="softcap+sinks"),
]


@pytest.fixture(params=["torch", "native"])
def cpu_backend(request):
    if request.param == "torch":
        return TorchPagedAttention(native_ops=False)
    require_cpu_kernels()
    return TorchPagedAttention(native_ops=True)


def test_reference_matches_transformers():
    # the reference above is gpt-oss's eager attention (sinks) and Gemma 2's (soft-capping)
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    torch.manual_seed(0)
    heads, kv_heads, dim, ctx, q_len, window = 8, 2, 16, 12, 5, 4
    q = 3 * torch.randn(q_len, heads, dim, dtype=torch.float64)
    k, v = (torch.randn(ctx, kv_heads, dim, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.float64)
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
    additive = torch.zeros(q_len, ctx, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.sinks = heads // kv_heads, dim, sinks
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], additive)
    scale = 0.3
    hf_sinks, _ = gpt_oss.eager_attention_forward(module, *args, scaling=scale)
    ours = reference(q, k, v, ctx, scale, window, None, sinks)
    torch.testing.assert_close(hf_sinks[0], ours)
    hf_cap, _ = gemma2.eager_attention_forward(module, *args, scaling=scale, softcap=CAP)
    ours = reference(q, k, v, ctx, scale, window, CAP, None)
    # (Gemma 2's softmax runs in fp32)
    torch.testing.assert_close(hf_cap[0], ours, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("specs", SPECS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_matches_reference(specs, window, softcap, has_sinks, cpu_backend):
    out, ref = run_case(specs, softcap, has_sinks, cpu_backend, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_features_change_the_output(softcap, has_sinks):
    # the cases above would not notice a feature that is ignored unless it moves the output
    specs = [(13, 1), (5, 1), (20, 7), (11, 11)]
    out, ref = run_case(specs, softcap, has_sinks, TorchPagedAttention(), window=6)
    plain, plain_ref = run_case(specs, None, False, TorchPagedAttention(), window=6)
    torch.testing.assert_close(plain.double(), plain_ref, atol=1e-5, rtol=1e-5)
    assert (out - plain).abs().max() > 0.05
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (12, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 6])
def test_head_dims_and_groups(head_dim, num_heads, num_kv_heads, window, cpu_backend):
    # ten decodes (the native op's whole-sequence items), three (per-head items), and prefills
    decodes = [(c, 1) for c in (13, 5, 32, 1, 40, 7, 16, 17, 2, 29)]
    for specs in (decodes, decodes[:3], [(3, 1), (40, 40), (30, 9)]):
        out, ref = run_case(
            specs,
            CAP,
            True,
            cpu_backend,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            window=window,
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_16_bit_cache_under_fp32(kv_dtype, softcap, has_sinks, cpu_backend):
    specs = [(13, 1), (5, 1), (32, 1), (20, 7), (11, 11)]
    out, ref = run_case(
        specs, softcap, has_sinks, cpu_backend, head_dim=64, window=6, kv_dtype=kv_dtype
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_bf16(window, softcap, has_sinks, cpu_backend):
    # (native: bf16 decode rows run the op, bf16 prefills the torch path)
    specs = [(13, 1), (5, 1), (32, 1), (20, 7), (11, 11)]
    out, ref = run_case(specs, softcap, has_sinks, cpu_backend, window=window, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_long_prefill_runs_in_slices_of_query_rows(monkeypatch):
    # a score budget of 3 rows x 8 heads x 40 keys: the 40-row chunk runs in 14 slices
    monkeypatch.setattr(paged_attention_cpu, "EAGER_SCORE_ELEMENTS", 3 * 8 * 40)
    for specs in ([(40, 40)], [(40, 17)]):
        out, ref = run_case(specs, CAP, True, TorchPagedAttention(), window=6)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_no_sinks_no_cap_is_the_plain_layer():
    layer = PagedAttention(8, 2, 32, torch.device("cpu"))
    assert layer.sinks is None and layer.logit_softcap is None
    assert list(layer.parameters()) == []
    layer = PagedAttention(8, 2, 32, torch.device("cpu"), logit_softcap=50.0, has_sinks=True)
    assert layer.logit_softcap == 50.0
    assert layer.sinks.dtype == torch.float32 and layer.sinks.shape == (8,)
    assert not layer.sinks.requires_grad
    assert dict(layer.named_parameters()).keys() == {"sinks"}


def test_native_ops_check_softcap_and_sinks():
    require_cpu_kernels()
    decode = torch.ops.hybridllm.paged_decode_attention
    prefill = torch.ops.hybridllm.prefill_attention
    q, cache = torch.randn(2, 4, 8), torch.zeros(2, 4, 4, 2, 8)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    kv = torch.randn(3, 2, 8)
    sinks = torch.zeros(4)
    # the defaults: neither
    decode(q, cache, tables, lens, 1.0, 0)
    prefill(q[:1], kv, kv, 1.0, 0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        decode(q, cache, tables, lens, 1.0, 0, -1.0, sinks)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        prefill(q[:1], kv, kv, 1.0, 0, -1.0, sinks)
    for bad in (sinks.double(), torch.zeros(3), torch.zeros(8)[::2], torch.zeros(1, 4)):
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
            decode(q, cache, tables, lens, 1.0, 0, 0.0, bad)
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
            prefill(q[:1], kv, kv, 1.0, 0, 0.0, bad)


def test_native_sinks_of_minus_infinity_are_no_sinks():
    # a sink of -inf weighs nothing: the output is plain attention's (capped or not)
    require_cpu_kernels()
    torch.manual_seed(0)
    q, kv = 3 * torch.randn(5, 4, 64), torch.randn(9, 2, 64)
    none = torch.full((4,), float("-inf"))
    for cap in (0.0, CAP):
        want = torch.ops.hybridllm.prefill_attention(q, kv, kv, 0.125, 0, cap)
        got = torch.ops.hybridllm.prefill_attention(q, kv, kv, 0.125, 0, cap, none)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


class NoVarlen:
    """A varlen function that must not be called (it cannot soft-cap or add sinks)."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("varlen attention called with soft-capping or sinks")


@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_cuda_backend_falls_back_to_the_torch_path(softcap, has_sinks):
    # on CPU tensors: no Triton, an injected varlen function; prefills and decodes take the
    # torch path where soft-capping or sinks are set
    backend = CudaPagedAttention(use_triton=False, varlen_fn=NoVarlen())
    specs = [(9, 1), (17, 1), (20, 7), (11, 11)]
    out, ref = run_case(specs, softcap, has_sinks, backend, window=6)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_plain_reference_agrees():
    # without either feature the reference is the existing tests' dense reference
    torch.manual_seed(0)
    q = torch.randn(5, 8, 16)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    torch.testing.assert_close(
        reference(q, k, v, 12, 0.25, 4, None, None), dense_reference(q, k, v, 12, 0.25, 4)
    )


# ---- Triton decode (CUDA, or CPU tensors under TRITON_INTERPRET=1) ---------------------------

needs_triton = pytest.mark.skipif(
    not _CAN_RUN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)"
)


@needs_triton
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_triton_decode_matches_reference(window, softcap, has_sinks):
    # decodes only (Triton), then a mixed step: Triton decodes, torch-path prefills
    for specs in ([(13, 1), (40, 1), (1, 1), (29, 1)], [(9, 1), (17, 1), (20, 7), (11, 11)]):
        backend = CudaPagedAttention(use_triton=True, varlen_fn=NoVarlen())
        out, ref = run_case(
            specs, softcap, has_sinks, backend, head_dim=64, block_size=16, window=window,
            device=_TRITON_DEVICE,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
@pytest.mark.parametrize("splits, per_split", [(3, 21), (64, 1)])
def test_triton_split_decode_matches_torch(window, softcap, has_sinks, splits, per_split):
    # the sinks join once, in the merge of the ranges; empty ranges still weigh nothing
    query, cache, prep = split_decode_case([1000, 1, 517, 33])
    query = QUERY_GAIN * query
    g = torch.Generator().manual_seed(5)
    sinks = (2 * torch.randn(query.shape[1], generator=g) + 1).to(query.device)
    sinks = sinks if has_sinks else None
    expected = TorchPagedAttention().decode(
        query, cache, prep, 0.125, window, logit_softcap=softcap, sinks=sinks
    )
    actual = triton_paged_decode(
        query, cache, prep.decode_block_tables, prep.decode_seq_lens, 0.125, window,
        splits, per_split, logit_softcap=softcap, sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("softcap,has_sinks", FEATURES)
def test_triton_bf16_decode(softcap, has_sinks):
    backend = CudaPagedAttention(use_triton=True, varlen_fn=NoVarlen())
    out, ref = run_case(
        [(13, 1), (40, 1), (1, 1)], softcap, has_sinks, backend, head_dim=64, block_size=16,
        window=6, dtype=torch.bfloat16, device=_TRITON_DEVICE,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
