"""Every supported architecture against Hugging Face transformers (tiny random models, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridllm.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from tests.model_helpers import (
    ARCHITECTURES,
    StepSequence,
    allocate_kv_caches,
    build_tiny_hf_model,
    load_our_model,
    make_step,
    make_tiny_model,
    num_kv_groups,
    scattered_block_tables,
    tiny_config,
)

NUM_BLOCKS = 96
PROMPT_LEN = 20
NUM_DECODE_STEPS = 32
ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request):
    """(arch, HF model, our model loaded from its state dict), built once per arch."""
    torch.manual_seed(0)
    hf = build_tiny_hf_model(request.param)
    return request.param, hf, load_our_model(hf)


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (length,), generator=gen).tolist()


def run(model, caches, seqs, block_size):
    """One step of `seqs` through the paged cache -> [num_tokens, vocab] logits."""
    input_ids, positions, meta = make_step(seqs, block_size, num_groups=num_kv_groups(model))
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, caches, meta))


def test_prefill_logits_match(models):
    _, hf, ours = models
    tokens = prompt(PROMPT_LEN, seed=1)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    caches = allocate_kv_caches(ours, NUM_BLOCKS, 4)
    table = scattered_block_tables(1, 8, NUM_BLOCKS)[0]
    logits = run(ours, caches, [StepSequence(tokens, 0, table)], 4)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_decode_matches_generate(models, block_size):
    _, hf, ours = models
    tokens = prompt(PROMPT_LEN, seed=2)
    with torch.inference_mode():
        generated = hf.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NUM_DECODE_STEPS,
        )[0, len(tokens) :].tolist()
    assert len(generated) == NUM_DECODE_STEPS

    total = len(tokens) + NUM_DECODE_STEPS
    table = scattered_block_tables(1, -(-total // block_size), NUM_BLOCKS, seed=block_size)[0]
    caches = allocate_kv_caches(ours, NUM_BLOCKS, block_size)
    logits = run(ours, caches, [StepSequence(tokens, 0, table)], block_size)
    ours_tokens = [int(logits[-1].argmax())]
    for step in range(NUM_DECODE_STEPS - 1):
        seq = StepSequence([ours_tokens[-1]], len(tokens) + step, table)
        ours_tokens.append(int(run(ours, caches, [seq], block_size)[-1].argmax()))
    assert ours_tokens == generated


def test_mixed_decode_and_chunked_prefill_batch(models):
    """Two decode rows + a chunk over a cached prefix, in one batch, equal each one alone."""
    _, hf, ours = models
    block_size = 4
    a, c, b = prompt(PROMPT_LEN, 3), prompt(13, 4), prompt(24, 5)
    tables = scattered_block_tables(3, 8, NUM_BLOCKS, seed=7)
    caches = allocate_kv_caches(ours, NUM_BLOCKS, block_size)
    # step 1: three prefills; b only computes its first 8 tokens (its cached prefix later)
    first = run(
        ours,
        caches,
        [
            StepSequence(a, 0, tables[0]),
            StepSequence(c, 0, tables[1]),
            StepSequence(b[:8], 0, tables[2]),
        ],
        block_size,
    )
    next_a = int(first[len(a) - 1].argmax())
    next_c = int(first[len(a) + len(c) - 1].argmax())
    # step 2: decode a, decode c, chunk b[8:16] attending to its cached prefix
    mixed = run(
        ours,
        caches,
        [
            StepSequence([next_a], len(a), tables[0]),
            StepSequence([next_c], len(c), tables[1]),
            StepSequence(b[8:16], 8, tables[2]),
        ],
        block_size,
    )
    with torch.inference_mode():
        expected_a = hf(torch.tensor([a + [next_a]])).logits[0, -1]
        expected_c = hf(torch.tensor([c + [next_c]])).logits[0, -1]
        expected_b = hf(torch.tensor([b[:16]])).logits[0, 8:16]
    torch.testing.assert_close(mixed[0], expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1], expected_c, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[2:], expected_b, atol=ATOL, rtol=0)

    # each alone through our engine (fresh caches) gives the same logits
    alone_caches = allocate_kv_caches(ours, NUM_BLOCKS, block_size)
    alone_b = run(ours, alone_caches, [StepSequence(b[:16], 0, tables[2])], block_size)[8:]
    torch.testing.assert_close(mixed[2:], alone_b, atol=ATOL, rtol=0)
    run(ours, alone_caches, [StepSequence(a, 0, tables[0])], block_size)
    alone_a = run(ours, alone_caches, [StepSequence([next_a], len(a), tables[0])], block_size)
    torch.testing.assert_close(mixed[0], alone_a[0], atol=ATOL, rtol=0)


def test_two_stage_split_equals_full_model(models):
    _, hf, full = models
    split = full.num_layers // 2
    first = load_our_model(hf, start_layer=0, end_layer=split)
    second = load_our_model(hf, start_layer=split)
    assert first.embed_tokens is not None and first.lm_head is None
    assert second.embed_tokens is None and second.lm_head is not None
    assert (first.num_layers_in_stage, second.num_layers_in_stage) == (
        split,
        full.num_layers - split,
    )
    assert not first.owns_weight("lm_head.weight")
    assert not any(second.owns_weight(n) for n in first.expected_weight_names() if ".layers." in n)

    block_size = 4
    tokens = prompt(PROMPT_LEN, seed=6)
    table = scattered_block_tables(1, 8, NUM_BLOCKS)[0]
    caches = [allocate_kv_caches(m, NUM_BLOCKS, block_size) for m in (full, first, second)]
    steps = [StepSequence(tokens, 0, table), StepSequence([7], len(tokens), table)]
    for seq in steps:
        input_ids, positions, meta = make_step([seq], block_size, num_groups=num_kv_groups(full))
        with torch.inference_mode():
            expected = full(input_ids, positions, caches[0], meta)
            hidden, residual = first(input_ids, positions, caches[1], meta)
            actual = second(input_ids, positions, caches[2], meta, hidden, residual)
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(models, dtype):
    _, hf, _ = models
    ours = load_our_model(hf, dtype=dtype)
    tokens = prompt(PROMPT_LEN, seed=8)
    table = scattered_block_tables(1, 8, NUM_BLOCKS)[0]
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    caches = allocate_kv_caches(ours, NUM_BLOCKS, 4)
    assert caches[0].dtype == dtype
    logits = run(ours, caches, [StepSequence(tokens, 0, table)], 4)
    assert logits.dtype == torch.float32
    # within 5% of the largest logit, or no further off than transformers in the same dtype
    # (Gemma 3's tiny config, four norms a layer of weights near 2, loses 20% in bf16 there)
    with torch.inference_mode():
        hf_half = copy.deepcopy(hf).to(dtype)(torch.tensor([tokens])).logits[0].float()
    bound = max(0.05 * expected.abs().max(), 1.2 * (hf_half - expected).abs().max())
    # every row but one in ten: rounding may flip a near-tie between two experts for a token
    # (MiniMax-M2's sigmoid router; either implementation may be the one that flips)
    assert ((logits - expected).abs().amax(-1) >= bound).float().mean() <= 0.1
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8

    # bf16 on CPU repacks the linears for oneDNN: same results up to bf16 rounding
    ours.process_weights_after_loading()
    packed = run(ours, allocate_kv_caches(ours, NUM_BLOCKS, 4), [StepSequence(tokens, 0, table)], 4)
    assert (packed - logits).abs().max() < min(0.4 * bound, 0.02 * expected.abs().max()) or (
        (packed - expected).abs().max() < bound
    )
    with pytest.raises(ValueError, match="after process_weights_after_loading"):
        ours.load_weights(hf.state_dict().items())


def test_load_from_saved_safetensors(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config.architectures[0])(config, torch.float32, torch.device("cpu"))
    loaded = model.load_weights(load_file(path / "model.safetensors").items())
    assert loaded == model.expected_weight_names()


def test_registry_and_bad_weights():
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "OPTForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "Glm4MoeForCausalLM",
        "GptOssForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    }
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    model = get_model_class("LlamaForCausalLM")(
        tiny_config("llama"), torch.float32, torch.device("cpu")
    )
    with pytest.raises(ValueError, match="expected shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.self_attn.o_proj.bias", torch.zeros(64))])
    # recomputed buffers and other stages' tensors are skipped silently
    assert (
        model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
        == set()
    )
    with pytest.raises(ValueError, match="layer range"):
        get_model_class("LlamaForCausalLM")(tiny_config("llama"), torch.float32, "cpu", 2, 2)


def test_rope_freq_factors_divide_the_frequencies():
    from hybridllm.layers.rotary_embedding import compute_inv_freq

    plain = compute_inv_freq(8, dict(rope_type="default", rope_theta=100.0))
    factors = [1.0, 2.0, 4.0, 8.0]
    scaled = compute_inv_freq(8, dict(rope_type="default", rope_theta=100.0, freq_factors=factors))
    torch.testing.assert_close(scaled, plain / torch.tensor(factors))
    with pytest.raises(ValueError, match="freq_factors has 3 entries, head_dim 8 needs 4"):
        compute_inv_freq(8, dict(rope_type="default", rope_theta=100.0, freq_factors=[1.0] * 3))


@pytest.mark.parametrize(
    "rope",
    [
        None,  # the tiny llama's default rope
        dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
        tiny_config("llama3").rope_parameters,
    ],
    ids=["default", "linear", "llama3"],
)
def test_rotary_tables_match_hf(rope):
    # logits over a short prompt barely see the scaled low frequencies: compare the tables
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hybridllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters

    config = tiny_config("llama")
    if rope is not None:
        config.rope_parameters = dict(rope)
    positions = torch.tensor([0, 1, 17, 1000, 4095, 9000])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(16, rope_parameters(config), torch.float32, torch.device("cpu"))
    angles = ours(positions, max_seq_len=9001)
    cos, sin_signed = angles.cos, angles.sin_signed
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin_signed[:, 0, 8:], hf_sin[0, :, 8:], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin_signed[:, 0, :8], -hf_sin[0, :, :8], atol=1e-6, rtol=0)
