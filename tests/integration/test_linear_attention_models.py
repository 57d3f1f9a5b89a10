"""Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet layers beside gated full attention) through the
engine against transformers' greedy tokens: prompts longer than one 64-token chunk of the delta
rule and a one-token prompt, batched at different lengths, prefilled in chunks, preempted, in one
worker and in two pipeline stages; the state slots are freed with the requests."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM
from tests.integration.test_moe_models_vs_hf import ENGINE_KWARGS, MAX_TOKENS, PARAMS
from tests.model_helpers import LINEAR_ATTENTION_CONFIGS, random_eager_model, tiny_config
from tests.moe_helpers import hf_greedy

ARCHS = tuple(LINEAR_ATTENTION_CONFIGS)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (70, 3, 1, 25)]


def run(model: str, **kwargs) -> tuple[list[list[int]], LLM]:
    """Greedy tokens for every prompt, and the (shut down) LLM."""
    llm = LLM(model, **{**ENGINE_KWARGS, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], PARAMS)
        return [list(o.outputs[0].token_ids) for o in outs], llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=ARCHS)
def saved_model(request, tmp_path_factory):
    """(saved HF folder, HF's greedy tokens for every prompt)."""
    torch.manual_seed(0)
    hf = random_eager_model(tiny_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]


def test_single_worker_matches_hf_and_frees_every_state_slot(saved_model):
    path, want = saved_model
    got, llm = run(str(path))
    assert got == want
    scheduler = llm.llm_engine.scheduler
    state = scheduler.block_manager.managers[-1]
    assert scheduler.block_manager.groups[-1].is_state
    assert state.num_free_blocks == state.num_blocks  # every request gave its slot back
    assert not scheduler.block_manager.enable_prefix_caching


def test_whole_prompts_preemption_and_two_stages(saved_model):
    path, want = saved_model
    # whole prompts in one step each (the 70-token one takes the chunked delta rule)
    got, _ = run(str(path), max_num_batched_tokens=128)
    assert got == want
    # 24 blocks of 4 tokens cannot hold the four requests at once: some are preempted and
    # recompute their state from a fresh slot
    got, llm = run(str(path), num_gpu_blocks_override=24)
    assert got == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    if path.name.startswith("qwen3_next"):  # the stages' split is the same for both
        got, _ = run(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp")
        assert got == want


def test_qwen3_5_multimodal_folder_runs_its_text_part(tmp_path):
    """Qwen3.5 ships as Qwen3_5MoeForConditionalGeneration: `text_config`, the language model's
    weights under `model.language_model.`, an image encoder under `model.visual.` (skipped)."""
    import json

    import transformers

    text = tiny_config("qwen3_5_moe")
    vision = transformers.Qwen3_5MoeVisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=16,
    )
    config = transformers.Qwen3_5MoeConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict()
    )
    torch.manual_seed(2)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]
    got, _ = run(str(tmp_path))
    assert got == want


def test_an_aborted_request_gives_its_slot_back_and_the_others_go_on(saved_model):
    """A request aborted mid-prefill frees its state slot at once; the requests beside it (one
    admitted into the freed slot) still match transformers."""
    path, want = saved_model
    prompts = make_prompts()
    llm = LLM(str(path), **{**ENGINE_KWARGS, "max_num_seqs": 2})
    try:
        engine = llm.llm_engine
        state = engine.scheduler.block_manager.managers[-1]
        engine.add_request("long", {"prompt_token_ids": prompts[0]}, PARAMS)
        engine.add_request("short", {"prompt_token_ids": prompts[1]}, PARAMS)
        engine.step()  # the 70-token prompt part-way through its chunks, in its slot
        assert state.get_block_ids("long") and state.num_free_blocks < state.num_blocks
        engine.abort_request("long")
        engine.add_request("third", {"prompt_token_ids": prompts[3]}, PARAMS)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        assert outputs["short"] == want[1] and outputs["third"] == want[3]
        assert "long" not in outputs or len(outputs["long"]) < MAX_TOKENS
        assert state.num_free_blocks == state.num_blocks
    finally:
        llm.shutdown()
