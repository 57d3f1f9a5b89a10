"""Latent attention: the absorbed decode equals the expanded form on the same cache."""

from __future__ import annotations

import pytest
import torch

from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.mla_attention import LatentAttention
from hybridllm.layers.prepared_attention import prepare_attention
from tests.kernel_helpers import require_cpu_kernels

HEADS, NOPE, ROPE, V, LATENT, BLOCK = 4, 16, 8, 12, 32, 4


def decode_step(seq_lens: list[int], num_blocks: int, seed: int = 0):
    """A random latent cache and a step of one decode row per sequence over it."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=g)
    max_blocks = max(-(-n // BLOCK) for n in seq_lens)
    order = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache
    tables = order[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    last = [
        int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)
    ]
    meta = AttentionMetadata(
        num_decodes=len(seq_lens),
        num_decode_tokens=len(seq_lens),
        slot_mapping=torch.tensor(last),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        seq_lens_cpu=list(seq_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
    )
    q_nope = torch.randn(len(seq_lens), HEADS, NOPE, generator=g)
    q_pe = torch.randn(len(seq_lens), HEADS, ROPE, generator=g)
    w_kv_b = 0.3 * torch.randn(HEADS, NOPE + V, LATENT, generator=g)
    return cache, prepare_attention(meta), q_nope, q_pe, w_kv_b


@pytest.mark.parametrize("seq_lens", [[1], [9], [13, 1, 6]])
def test_absorbed_decode_equals_expanded(seq_lens):
    cache, prep, q_nope, q_pe, w_kv_b = decode_step(seq_lens, num_blocks=16)
    attention = LatentAttention(HEADS, NOPE, ROPE, V, LATENT, scale=0.2)
    latent = cache.view(-1, LATENT + ROPE)[prep.slot_mapping]  # the step's rows, as written
    absorbed = attention.forward(q_nope, q_pe, latent, cache, prep, w_kv_b)
    attention.absorb_decode = False
    expanded = attention.forward(q_nope, q_pe, latent, cache, prep, w_kv_b)
    assert absorbed.shape == (len(seq_lens), HEADS * V)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_expanded_decode_attends_over_its_own_context_only():
    # a reference by hand for one sequence: per-head keys [k_nope, k_pe], values, softmax
    cache, prep, q_nope, q_pe, w_kv_b = decode_step([7], num_blocks=8, seed=1)
    attention = LatentAttention(HEADS, NOPE, ROPE, V, LATENT, scale=0.2)
    blocks = prep.decode_block_tables[0, :2].long()
    rows = cache[blocks].reshape(-1, LATENT + ROPE)[:7]  # [7, L + R]
    kv = torch.einsum("tl,hdl->thd", rows[:, :LATENT], w_kv_b)  # [7, H, nope + v]
    keys = torch.cat((kv[..., :NOPE], rows[:, None, LATENT:].expand(7, HEADS, ROPE)), dim=-1)
    query = torch.cat((q_nope[0], q_pe[0]), dim=-1)  # [H, nope + rope]
    probs = torch.softmax(0.2 * torch.einsum("hd,thd->ht", query, keys), dim=-1)
    want = torch.einsum("ht,thv->hv", probs, kv[..., NOPE:]).reshape(1, -1)
    latent = rows[-1:]
    got = attention.forward(q_nope, q_pe, latent, cache, prep, w_kv_b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_up_projections_from_q8_0_blocks_are_close_to_floats():
    # a model computing from blocks absorbs through hybridllm::gguf_head_linear on Q8_0 copies
    # of the up-projections (nope and latent widths multiples of 32 here)
    require_cpu_kernels()
    heads, nope, v, latent_dim = 4, 32, 12, 64
    g = torch.Generator().manual_seed(2)
    attention = LatentAttention(heads, nope, ROPE, v, latent_dim, scale=0.2)
    w_kv_b = 0.3 * torch.randn(heads, nope + v, latent_dim, generator=g)
    cache = torch.randn(8, BLOCK, latent_dim + ROPE, generator=g)
    _, prep, _, _, _ = decode_step([7, 3], num_blocks=8, seed=3)
    q_nope = torch.randn(2, heads, nope, generator=g)
    q_pe = torch.randn(2, heads, ROPE, generator=g)
    context = cache[:2].reshape(-1, latent_dim + ROPE)[:6]  # a 6-token prompt's latents
    q_prompt = torch.randn(6, heads, nope, generator=g), torch.randn(6, heads, ROPE, generator=g)
    want = attention.decode_absorbed(q_nope, q_pe, cache, prep, w_kv_b)
    want_prefill = attention.expanded(*q_prompt, context, None, w_kv_b)
    for activations in (0, 1):  # fp32 and int8 activations
        attention.use_head_blocks(w_kv_b, activations)
        # the floats are not needed any more (the model drops them)
        got = attention.decode_absorbed(q_nope, q_pe, cache, prep, None)
        got_prefill = attention.expanded(*q_prompt, context, None, None)
        # Q8_0 weights (and int8 activations): about 1% of the values' scale
        for g_, w_ in ((got, want), (got_prefill, want_prefill)):
            assert (g_ - w_).abs().max() < 0.02 * w_.abs().max()
            assert not torch.equal(g_, w_)  # the blocks were used


def test_up_projections_in_x8_groups_give_the_plain_blocks_results():
    # with int8 activations on an AVX512-VNNI build the Q8_0 copies are repacked into groups of
    # 8 rows (every row count here a multiple of 8): the same integer sums as the plain blocks
    # (unpacked back from them), so equal to fp32 rounding
    require_cpu_kernels()
    if 8 not in torch.ops.hybridllm.x8_source_types():  # Q8_0
        pytest.skip("this build computes no Q8_0 in x8 groups (AVX512-VNNI only)")
    from hybridllm.layers.gguf_linear import INT8_ACTIVATIONS, X8_SOURCE_TYPES, unpack_x8
    from hybridllm.layers.mla_attention import HeadBlocks

    heads, nope, v, latent_dim = 4, 32, 16, 64
    g = torch.Generator().manual_seed(4)
    w_kv_b = 0.3 * torch.randn(heads, nope + v, latent_dim, generator=g)
    cache = torch.randn(8, BLOCK, latent_dim + ROPE, generator=g)
    _, prep, _, _, _ = decode_step([7, 3], num_blocks=8, seed=3)
    q_nope = torch.randn(2, heads, nope, generator=g)
    q_pe = torch.randn(2, heads, ROPE, generator=g)
    context = cache[:2].reshape(-1, latent_dim + ROPE)[:6]
    q_prompt = torch.randn(6, heads, nope, generator=g), torch.randn(6, heads, ROPE, generator=g)
    attention = LatentAttention(heads, nope, ROPE, v, latent_dim, scale=0.2)
    attention.use_head_blocks(w_kv_b, INT8_ACTIVATIONS)
    grouped = attention.head_blocks
    assert grouped.ggml_type in X8_SOURCE_TYPES
    results = []
    for blocks in (grouped, None):
        if blocks is None:  # the same weights as plain Q8_0 rows
            kv_b, uk_t, uv = (
                unpack_x8(b, grouped.ggml_type)[0] for b in (grouped.kv_b, grouped.uk_t, grouped.uv)
            )
            source = X8_SOURCE_TYPES[grouped.ggml_type]
            blocks = HeadBlocks(kv_b, uk_t, uv, source, INT8_ACTIVATIONS)
        attention.head_blocks = blocks
        results.append(
            (
                attention.decode_absorbed(q_nope, q_pe, cache, prep, None),
                attention.expanded(*q_prompt, context, None, None),
            )
        )
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
