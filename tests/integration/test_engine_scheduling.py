"""The same request gives the same tokens however the scheduler runs it."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.worker.kv_cache_sizing import cpu_fixed_bytes
from tests.model_helpers import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 200, (20,), generator=g).tolist()
    tails = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 6, 11, 3)]
    # Shared prefixes exercise prefix-cache hits; different lengths exercise batching.
    return [{"prompt_token_ids": shared + t} for t in tails] + [
        {"prompt_token_ids": torch.randint(3, 200, (9,), generator=g).tolist()}
    ]


def _run(model_path, prompts, **kwargs):
    llm = LLM(
        model_path, dtype="float32", max_model_len=128, block_size=4, use_tqdm=False, **kwargs
    )
    try:
        outs = llm.generate(prompts, PARAMS)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    # One request at a time, no prefix caching: the plainest schedule there is.
    llm = LLM(
        model_path,
        dtype="float32",
        max_model_len=128,
        block_size=4,
        use_tqdm=False,
        enable_prefix_caching=False,
    )
    try:
        return [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    finally:
        llm.shutdown()


def test_batched_with_prefix_caching(model_path, prompts, reference):
    tokens, stats = _run(model_path, prompts)
    assert tokens == reference
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prefix_cache_hits_give_same_tokens(model_path, prompts, reference):
    llm = LLM(model_path, dtype="float32", max_model_len=128, block_size=4, use_tqdm=False)
    try:
        first = llm.generate(prompts, PARAMS)
        second = llm.generate(prompts, PARAMS)  # now every shared block is cached
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert any(o.num_cached_tokens > 0 for o in second)


def test_chunked_prefill_small_budget(model_path, prompts, reference):
    tokens, _ = _run(model_path, prompts, max_num_batched_tokens=7)
    assert tokens == reference


def test_no_chunked_prefill(model_path, prompts, reference):
    tokens, _ = _run(model_path, prompts, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert tokens == reference


def test_preemption_under_tiny_kv_budget(model_path, prompts, reference):
    # 14 blocks x 4 tokens: two ~37-token sequences cannot both stay resident.
    tokens, stats = _run(model_path, prompts, num_gpu_blocks_override=14)
    assert tokens == reference
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_too_long_prompt_fails_alone(model_path, prompts, reference):
    llm = LLM(model_path, dtype="float32", max_model_len=32, block_size=4, use_tqdm=False)
    try:
        too_long = {"prompt_token_ids": list(range(3, 43))}
        outs = llm.generate([prompts[4], too_long, ""], SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.shutdown()
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    assert outs[1].error and "max_model_len=32" in outs[1].error
    assert outs[1].error_from_request and not outs[0].error_from_request
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[2].error and "empty" in outs[2].error


def test_n_samples_and_seed(model_path, prompts):
    llm = LLM(model_path, dtype="float32", max_model_len=128, block_size=4, use_tqdm=False)
    try:
        p = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
        a = llm.generate(prompts[:2], p)
        b = llm.generate(prompts[1:2], p)
    finally:
        llm.shutdown()
    samples = [o.token_ids for o in a[1].outputs]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1
    # Seeded: the same request gives the same samples alone or beside another request.
    assert [o.token_ids for o in b[0].outputs] == samples


def test_max_cpu_memory_bounds_the_kv_cache(model_path):
    # The cap holds the CPU weights, activation workspace and KV cache together: the engine must
    # size the cache from what the cap leaves, and still generate within it.
    free = LLM(model_path, dtype="float32", max_model_len=128, use_tqdm=False)
    runner = free.llm_engine.executor.workers[0].model_runner
    fixed = cpu_fixed_bytes(free.llm_engine.config, free.llm_engine.config.plan.workers())
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert fixed > weights  # the activation workspace counts too
    per_block = runner.kv_cache_bytes_per_block()
    uncapped = free.llm_engine.num_blocks
    free.shutdown()
    cap = fixed + 8 * per_block
    llm = LLM(model_path, dtype="float32", max_model_len=128, max_cpu_memory=cap, use_tqdm=False)
    try:
        assert llm.llm_engine.num_blocks == 8 < uncapped
        out = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4)
        )
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_generate_from_another_thread_warns_once_and_still_works(
    model_path, prompts, reference, caplog
):
    import threading

    llm = LLM(model_path, dtype="float32", max_model_len=128, block_size=4, use_tqdm=False)
    try:
        with caplog.at_level("WARNING", logger="hybridllm.entrypoints.llm"):
            llm.generate(prompts[:1], PARAMS)  # the loading thread: no warning
            assert not caplog.records
            outs = []
            for _ in range(2):
                t = threading.Thread(target=lambda: outs.append(llm.generate(prompts, PARAMS)))
                t.start()
                t.join()
        warnings = [r for r in caplog.records if "another thread" in r.getMessage()]
        assert len(warnings) == 1 and "create the LLM on the thread" in warnings[0].getMessage()
        assert [o.outputs[0].token_ids for o in outs[1]] == reference
    finally:
        llm.shutdown()
