"""The GPU workers' profiling forward runs the step budget's real shape (checked on the CPU)."""

from __future__ import annotations

import pytest

from hybridllm import LLM
from tests.model_helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize(
    "chunked, budget, expected",
    [
        (False, 160, 160),  # whole prompts: 64 + 64 + 32 tokens, no cap on the budget
        (True, 16, 16),  # the last 16-token chunk of a 64-token prompt, over its prefix
    ],
)
def test_profile_forward_runs_the_step_budget(model_path, chunked, budget, expected):
    llm = LLM(
        model_path,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        max_num_seqs=4,
        kv_cache_memory="16MiB",
        use_tqdm=False,
    )
    try:
        runner = llm.llm_engine.executor.workers[0].model_runner
        calls = []
        assert runner.profile_forward(lambda: calls.append(len(runner.kv_caches))) == expected
        assert calls == [runner.model.num_layers_in_stage]  # called once, with the cache built
        assert runner.kv_caches == []
    finally:
        llm.shutdown()
