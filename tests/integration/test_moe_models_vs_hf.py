"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from tests.moe_helpers import (
    MOE_ARCHITECTURES,
    build_tiny_moe_model,
    hf_greedy,
    make_tiny_moe_model,
    write_moe_gguf,
)

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    block_size=4,
    max_num_batched_tokens=16,  # prompts of 17+ tokens are prefilled in chunks
    kv_cache_memory="16MiB",
    skip_tokenizer_init=True,
    use_tqdm=False,
)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 320, (13,), generator=g).tolist()
    # a shared 13-token prefix (prefix-cache hits on its full blocks) and lengths 1 to 22
    tails = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 4)]
    single = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 6)]
    return [shared + t for t in tails] + single


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_model(request, tmp_path_factory):
    """(arch, saved HF folder, HF model, HF's greedy tokens for every prompt)."""
    arch = request.param
    hf = build_tiny_moe_model(arch)
    path = make_tiny_moe_model(arch, tmp_path_factory.mktemp(arch))
    return arch, path, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]


def generate(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, **{**ENGINE_KWARGS, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_single_worker_matches_hf(moe_model):
    # prompts sharing a prefix, chunked prefill (16-token steps) and decodes batched together
    _, path, _, want = moe_model
    assert generate(str(path)) == want


def test_pipeline_parallel_mp_matches_hf(moe_model):
    _, path, _, want = moe_model
    got = generate(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert got == want


def test_gguf_file_matches_hf(moe_model, tmp_path):
    # llama.cpp's layout: stacked experts, router, shared expert; Mixtral as `llama` + experts
    arch, _, hf, want = moe_model
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", hf)
    assert generate(str(path), enable_prefix_caching=False) == want


def test_tensor_parallel_is_refused_with_a_clear_error(moe_model):
    _, path, _, _ = moe_model
    with pytest.raises(ValueError, match="tensor parallelism is not supported.*pipeline"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE_KWARGS)


def test_models_load_transformers5_stacked_experts():
    # transformers 5's state dict stacks the experts ([E, 2I, H] gate_up, [E, H, I] down)
    from tests.model_helpers import load_our_model

    hf = build_tiny_moe_model("qwen2_moe")
    ours = load_our_model(hf)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    tokens = make_prompts()[0]
    from tests.model_helpers import StepSequence, allocate_kv_caches, make_step

    ids, positions, meta = make_step([StepSequence(tokens, 0, list(range(8)))], 4)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
        got = ours.compute_logits(ours(ids, positions, allocate_kv_caches(ours, 16, 4), meta))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # layer 1 is dense (mlp_only_layers): a gated MLP of intermediate_size
    assert type(ours.layers[1].mlp).__name__ == "GatedMLP"
    assert type(ours.layers[0].mlp).__name__ == "SparseMoeBlock"
