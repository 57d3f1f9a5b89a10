"""Sliding-window KV cache groups end to end: tiny random Mistral (every layer sliding) and Qwen2
with `layer_types` mixing sliding and full layers generate Hugging Face's greedy tokens for
prompts longer than the window, with and without prefix caching and chunked prefill, while the
sliding layers hold only their window's blocks."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from tests.model_helpers import make_tiny_tokenizer, random_eager_model, tiny_config

WINDOW = 16
NEW_TOKENS = 24
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def sliding_config(arch: str):
    config = tiny_config(arch)
    config.sliding_window = WINDOW
    if arch == "qwen2":
        config.num_hidden_layers = len(LAYER_TYPES)
        config.use_sliding_window = True
        config.max_window_layers = 0
        config.layer_types = list(LAYER_TYPES)
    return config


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = random_eager_model(sliding_config(request.param))
    path = tmp_path_factory.mktemp(f"sliding-{request.param}")
    hf.save_pretrained(path)
    make_tiny_tokenizer(hf.config.vocab_size).save_pretrained(path)
    return request.param, str(path), hf


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 3 * WINDOW, 70)]


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def generate(llm: LLM, token_prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 256, "block_size": 4, **kwargs}
    return LLM(path, use_tqdm=False, **kwargs)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8, "block_size": 8},  # chunks of 8 cross the window
        {"native_decode_layer": False},  # each layer's forward, the native attention ops
        {"cpu_kernels": False},  # torch alone
        # two stages (Qwen2's second holds sliding layers only), each its layers' groups
        {"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
        {"distributed_executor_backend": "mp"},  # block tables per group through the queue
        # the weight streamer's path, on the host: a compact cache per group
        {
            "pipeline_parallel_size": 2,
            "stream_device": "cpu",
            "stream_threshold": 0,
            "distributed_executor_backend": "uni",
        },
    ],
    ids=[
        "default",
        "no-prefix-caching",
        "chunked-prefill",
        "per-layer",
        "torch-ops",
        "pipeline",
        "mp",
        "streamed",
    ],
)
def test_greedy_tokens_match_hf(tiny, engine_kwargs):
    arch, path, hf = tiny
    token_prompts = prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p) for p in token_prompts]
    llm = make_llm(path, **engine_kwargs)
    try:
        groups = llm.llm_engine.scheduler.block_manager.groups
        assert [g.sliding_window for g in groups] == (
            [WINDOW] if arch == "mistral" else [None, WINDOW]
        )
        assert generate(llm, token_prompts) == expected, arch
        if engine_kwargs.get("enable_prefix_caching", True):
            # the same prompts again: their prefixes come from the cache
            scheduler = llm.llm_engine.scheduler
            hits = scheduler.prefix_cache_hit_tokens
            assert generate(llm, token_prompts) == expected, arch
            assert scheduler.prefix_cache_hit_tokens > hits
    finally:
        llm.shutdown()


def test_sliding_blocks_stay_within_the_window(tiny):
    arch, path, hf = tiny
    llm = make_llm(path, max_num_batched_tokens=16)
    try:
        engine = llm.llm_engine
        prompt = (prompts(hf.config.vocab_size)[2] * 2)[:100]
        # the context reaches 8 windows
        params = SamplingParams(temperature=0, max_tokens=8 * WINDOW - 100 + 4, ignore_eos=True)
        engine.add_request("long", {"prompt_token_ids": prompt}, params)
        managers = engine.scheduler.block_manager.managers
        request = engine.scheduler.requests["long"]
        while engine.has_unfinished_requests():
            engine.step()
            if request.num_computed_tokens >= 8 * WINDOW - 1 and not request.is_finished():
                full_attention_blocks = -(-request.num_computed_tokens // 4)
                for spec, manager in zip(engine.scheduler.block_manager.groups, managers):
                    null = getattr(manager, "null_block", None)  # sliding groups only
                    in_use = sum(b is not null for b in manager.req_to_blocks["long"])
                    if spec.sliding_window is None:
                        assert in_use == full_attention_blocks
                    else:
                        assert in_use <= -(-(WINDOW - 1 + 16) // 4) + 1 < full_attention_blocks
        assert request.num_computed_tokens >= 8 * WINDOW - 1
    finally:
        llm.shutdown()
