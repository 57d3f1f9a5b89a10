"""WeightStreamer on a tiny stage with the host as its "accelerator": when it streams, what it
stages, and that a streamed step computes what the CPU layers compute."""

from __future__ import annotations

import pytest
import torch

from hybridllm.worker.weight_streamer import NUM_SLOTS, WeightStreamer
from tests.model_helpers import (
    StepSequence,
    allocate_kv_caches,
    build_tiny_hf_model,
    load_our_model,
    make_step,
    scattered_block_tables,
    tiny_config,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 16
STAGE_END = 2  # layers [0, 2) of 3: a first pipeline stage, which returns (hidden, residual)


def tiny_stage(arch: str = "llama") -> torch.nn.Module:
    """The first stage of a tiny fp32 model, weights loaded and not yet processed (the weight
    streamer copies them before the CPU repacks its own)."""
    return load_our_model(build_tiny_hf_model(arch), end_layer=STAGE_END)


@pytest.fixture(scope="module")
def stage() -> torch.nn.Module:
    return tiny_stage()


def streamer_for(model, threshold: int = 0, kv_tokens: int = 64) -> WeightStreamer:
    return WeightStreamer(model, "cpu", torch.float32, threshold, kv_tokens)


def step_of(*seqs: StepSequence):
    return make_step(list(seqs), BLOCK_SIZE)


# ---- the per-step choice --------------------------------------------------------------------


def test_wants_steps_of_at_least_threshold_tokens(stage):
    streamer = streamer_for(stage, threshold=8)
    caches = allocate_kv_caches(stage, NUM_BLOCKS, BLOCK_SIZE)
    _, _, seven = step_of(StepSequence(list(range(7)), 0, [3, 4]))
    _, _, eight = step_of(StepSequence(list(range(5)), 0, [3, 4]), StepSequence([9, 9, 9], 0, [5]))
    assert not streamer.wants(seven, caches)
    assert streamer.wants(eight, caches)  # counted over all the step's sequences
    assert not streamer.wants(eight, [])  # no KV cache (a profiling run): stays on the CPU


def test_threshold_zero_streams_every_step_and_a_negative_one_none(stage):
    caches = allocate_kv_caches(stage, NUM_BLOCKS, BLOCK_SIZE)
    _, _, decode = step_of(StepSequence([7], 5, [2, 6]))
    _, _, big = step_of(StepSequence(list(range(16)), 0, [0, 1, 2, 3]))
    assert streamer_for(stage, threshold=0).wants(decode, caches)
    assert not streamer_for(stage, threshold=-1).wants(big, caches)


def test_wants_only_steps_whose_kv_blocks_fit_a_slot(stage):
    caches = allocate_kv_caches(stage, NUM_BLOCKS, BLOCK_SIZE)
    # three distinct blocks (12 KV rows): block 5 is a prefix both sequences share
    _, _, shared = step_of(
        StepSequence(list(range(6)), 0, [5, 6]), StepSequence(list(range(3)), 4, [5, 7])
    )
    assert streamer_for(stage, kv_tokens=12).wants(shared, caches)
    assert not streamer_for(stage, kv_tokens=11).wants(shared, caches)
    # only the blocks the sequences reach count, not the padding of their tables
    _, _, short = step_of(StepSequence(list(range(3)), 0, [1, 2, 3, 4]))
    assert streamer_for(stage, kv_tokens=4).wants(short, caches)


# ---- what it stages -------------------------------------------------------------------------


def _layer_params(arch: str) -> int:
    """Elements of one decoder layer's weights, from the config: q, k, v, o; gate, up, down;
    two norms."""
    c = tiny_config(arch)
    head_dim = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    return attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


@pytest.mark.parametrize("kv_tokens", [16, 64])
def test_staging_bytes_are_two_slots_of_one_layer_and_its_kv_rows(stage, kv_tokens):
    c = tiny_config("llama")
    kv_row = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    streamer = streamer_for(stage, kv_tokens=kv_tokens)
    fp32 = 4
    weights = _layer_params("llama") * fp32
    assert streamer.host_bytes_per_layer == weights  # float weights cross as they are
    assert streamer.staging_bytes == NUM_SLOTS * (weights + 2 * kv_tokens * kv_row * fp32)


# ---- a streamed step ------------------------------------------------------------------------


def _random_caches(model, seed: int) -> list[torch.Tensor]:
    """Caches full of noise: blocks a step does not read must not matter, nor change."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    return caches


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a 12-token sliding window
def test_streamed_steps_compute_what_the_cpu_layers_compute(arch):
    model = tiny_stage(arch)
    streamer = streamer_for(model, threshold=4)
    model.process_weights_after_loading()  # the CPU's own weights as they will run
    cpu_caches = _random_caches(model, seed=1)
    streamed_caches = [cache.clone() for cache in cpu_caches]
    first, second = scattered_block_tables(2, 4, NUM_BLOCKS, seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 300, (30,), generator=g).tolist()
    steps = [
        # two prefills into shuffled blocks
        [StepSequence(tokens[:9], 0, first), StepSequence(tokens[9:15], 0, second)],
        # a decode and a chunk that read the K/V the first step wrote back; the chunk's
        # sequence (14 tokens) outgrows mistral's window
        [StepSequence(tokens[15:16], 9, first), StepSequence(tokens[16:24], 6, second)],
    ]
    for number, seqs in enumerate(steps, start=1):
        input_ids, positions, metadata = step_of(*seqs)
        with torch.inference_mode():
            want_hidden, want_residual = model(input_ids, positions, cpu_caches, metadata)
            embedded = model.embed_tokens(input_ids)
        assert streamer.wants(metadata, streamed_caches)
        hidden, residual = streamer.run(
            model.layers, streamed_caches, embedded, None, positions, metadata
        )
        assert streamer.num_streamed_steps == number
        assert hidden.dtype == torch.float32 and hidden.device.type == "cpu"
        torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(residual, want_residual, atol=1e-5, rtol=1e-4)
        # the step's K/V rows are back in the CPU caches, and nothing else changed
        for streamed, cpu in zip(streamed_caches, cpu_caches):
            torch.testing.assert_close(streamed, cpu, atol=1e-5, rtol=1e-4)


def test_run_without_wants_on_the_same_step_still_stages_its_blocks(stage):
    streamer = streamer_for(stage, threshold=0)
    caches = _random_caches(stage, seed=4)
    _, _, other = step_of(StepSequence([1, 2, 3], 0, [9]))
    input_ids, positions, metadata = step_of(StepSequence([5, 6, 7, 8, 9], 0, [3, 4]))
    assert streamer.wants(other, caches)  # chose for another step, which then did not run
    before = [cache.clone() for cache in caches]
    embedded = stage.embed_tokens(input_ids)
    hidden, _ = streamer.run(stage.layers, caches, embedded, None, positions, metadata)
    assert hidden.shape == embedded.shape
    # it wrote the K/V of this step's slots (blocks 3 and 4), not of the other step's (9)
    changed = {
        int(block)
        for cache, old in zip(caches, before)
        for block in (cache != old).any(dim=(0, 2, 3, 4)).nonzero().flatten()
    }
    assert changed == {3, 4}


def test_streamed_steps_carry_soft_capping_and_sinks(monkeypatch):
    # attention with soft-capping and sinks (Gemma 2's and gpt-oss's, here on the tiny Llama):
    # each attention gets its own sink logits, so twins that kept theirs would compute wrongly
    import hybridllm.models.llama as llama
    from hybridllm.layers.attention import PagedAttention

    made = []

    class CappedWithSinks(PagedAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, logit_softcap=3.0, has_sinks=True, **kwargs)
            g = torch.Generator().manual_seed(len(made))
            self.sinks.data.copy_(2 * torch.randn(self.num_heads, generator=g))
            made.append(self)

    monkeypatch.setattr(llama, "PagedAttention", CappedWithSinks)
    test_streamed_steps_compute_what_the_cpu_layers_compute("llama")
    assert len(made) == STAGE_END + NUM_SLOTS  # the stage's layers and the slots' twins
