"""DeepSeek-V2/V3, GLM-4.7-Flash (MLA) and GLM-4.5 against transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from tests.deepseek_helpers import (
    DEEPSEEK_ARCHITECTURES,
    build_tiny_deepseek_model,
    make_tiny_deepseek_model,
)
from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, PARAMS, make_prompts
from tests.moe_helpers import hf_greedy

MAX_TOKENS = PARAMS.max_tokens


@pytest.fixture(scope="module", params=DEEPSEEK_ARCHITECTURES)
def model(request, tmp_path_factory):
    """(arch, saved HF folder, HF's greedy tokens for every prompt)."""
    arch = request.param
    hf = build_tiny_deepseek_model(arch)
    path = make_tiny_deepseek_model(arch, tmp_path_factory.mktemp(arch))
    return arch, path, [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]


def only(model, *archs: str) -> None:
    """Skip `model` unless it is one of `archs`: the placement and loading tests run on one MLA
    and one GQA model (the rest share their code)."""
    if model[0] not in archs:
        pytest.skip(f"run on {' and '.join(archs)} only")


def generate(model: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **{**ENGINE_KWARGS, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        stats = llm.llm_engine.get_stats()
        return [list(o.outputs[0].token_ids) for o in outs], stats
    finally:
        llm.shutdown()


def test_single_worker_matches_hf(model):
    # prompts sharing a prefix, chunked prefill (16-token steps) and decodes batched together
    _, path, want = model
    assert generate(str(path))[0] == want


def test_pipeline_parallel_mp_matches_hf(model):
    _, path, want = model
    got, _ = generate(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert got == want


def test_preemption_leaves_tokens_unchanged(model):
    # 12 blocks of 4 tokens cannot hold the four sequences at once: the latest is preempted
    # and recomputed, its latent rows written again
    _, path, want = model
    got, stats = generate(str(path), num_gpu_blocks_override=12, enable_prefix_caching=False)
    assert stats.num_preemptions > 0
    assert got == want


def test_tensor_parallel_is_refused_with_a_clear_error(model):
    only(model, "deepseek_v3", "glm4_moe")
    _, path, _ = model
    with pytest.raises(ValueError, match="tensor parallelism is not supported.*pipeline"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE_KWARGS)


def test_mla_cache_holds_one_latent_row_a_token(model):
    only(model, "deepseek_v3")  # GLM-4.5 caches per-head keys and values
    _, path, _ = model
    llm = LLM(str(path), **ENGINE_KWARGS)
    try:
        runner = llm.llm_engine.executor.workers[0].model_runner
        config = runner.model.hf_config
        width = config.kv_lora_rank + config.qk_rope_head_dim
        # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] a layer, nothing per head
        assert all(c.shape[1:] == (4, width) for c in runner.kv_caches)
        itemsize = runner.kv_caches[0].element_size()
        assert runner.kv_cache_bytes_per_block() == 3 * 4 * width * itemsize
    finally:
        llm.shutdown()


def test_cpu_moe_places_the_routed_experts_on_the_host(model):
    # no GPU here: the stage's device is the CPU too, but the experts take the split path
    # (own experts_device, hidden states and router logits across, the routed sum back)
    only(model, "deepseek_v3", "glm4_moe")
    _, path, want = model
    llm = LLM(str(path), **{**ENGINE_KWARGS, "n_cpu_moe": 2})
    try:
        assert [s.cpu_expert_layers for s in llm.llm_engine.config.plan.stages] == [2]
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()


def test_mtp_layers_after_the_last_are_skipped(model, tmp_path):
    # DeepSeek-V3 and GLM-4.5 checkpoints carry their multi-token-prediction (NextN) layer as
    # `model.layers.{num_hidden_layers}.*`: no stage owns it, and loading goes on without it
    import shutil

    from safetensors.torch import save_file

    only(model, "deepseek_v3")
    _, path, want = model
    folder = tmp_path / "with-mtp"
    shutil.copytree(path, folder)
    hidden = 96
    save_file(
        {
            "model.layers.3.eh_proj.weight": torch.randn(hidden, 2 * hidden),
            "model.layers.3.enorm.weight": torch.ones(hidden),
            "model.layers.3.hnorm.weight": torch.ones(hidden),
            "model.layers.3.self_attn.o_proj.weight": torch.randn(hidden, hidden),
            "model.layers.3.shared_head.norm.weight": torch.ones(hidden),
        },
        str(folder / "mtp.safetensors"),
    )
    assert generate(str(folder))[0] == want


def test_quantized_model_keeps_its_up_projections_as_blocks(tmp_path, monkeypatch):
    # --quantization q8_0 on a CPU worker: the linears are Q8_0 blocks, so MLA's up-projections
    # are too (prefill through gguf_linear, decode through gguf_head_linear) and the float
    # kv_b_proj is dropped; nope 32 and kv_lora_rank 64 are whole 32-weight blocks
    from hybridllm.models.deepseek_v2 import MLAttention
    from tests.kernel_helpers import require_cpu_kernels

    require_cpu_kernels()
    path = make_tiny_deepseek_model(
        "deepseek_v3", tmp_path / "v3", qk_nope_head_dim=32, kv_lora_rank=64
    )
    prompts = make_prompts()
    kwargs = {**ENGINE_KWARGS, "quantization": "q8_0"}
    llm = LLM(str(path), **kwargs)
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        for layer in model.layers:
            assert layer.self_attn.attn.head_blocks is not None
            assert layer.self_attn.kv_b_proj.numel() == 0
        decode = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], decode)
    finally:
        llm.shutdown()
    # the same Q8_0 model with float up-projections, teacher-forced over the same tokens: each
    # decoded token's logprob is within the up-projections' Q8_0 error (the rest of the model
    # is the same blocks, so a comparison with transformers would measure those instead)
    monkeypatch.setattr(MLAttention, "blocks_fit", lambda self: False)
    llm = LLM(str(path), **kwargs)
    try:
        model = llm.llm_engine.executor.workers[0].model_runner.model
        assert model.layers[0].self_attn.attn.head_blocks is None
        forced = [
            {"prompt_token_ids": p + list(o.outputs[0].token_ids)} for p, o in zip(prompts, outs)
        ]
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        floats = llm.generate(forced, score)
    finally:
        llm.shutdown()
    for prompt, out, ref in zip(prompts, outs, floats):
        tokens = out.outputs[0].token_ids
        for j, (token, got) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            want = ref.prompt_logprobs[len(prompt) + j][token].logprob
            assert abs(got[token].logprob - want) < 0.05
