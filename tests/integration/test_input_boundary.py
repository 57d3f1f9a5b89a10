"""`LLM` at the context boundary: a prompt of max_model_len - 1 tokens generates one token,
one of max_model_len or more fails alone with the validator's words (the server's too)."""

from __future__ import annotations

import pytest

from hybridllm import LLM, SamplingParams
from tests.model_helpers import make_tiny_model

MAX_LEN = 32


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=4, use_tqdm=False)
    yield llm
    llm.shutdown()


def test_llm_boundary(llm):
    prompts = [{"prompt_token_ids": [5] * length} for length in (MAX_LEN - 1, MAX_LEN, MAX_LEN + 1)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fits, exact, over = llm.generate(prompts, params)
    assert fits.error is None and len(fits.outputs[0].token_ids) == 1
    assert fits.outputs[0].finish_reason == "length"
    for out, length in ((exact, MAX_LEN), (over, MAX_LEN + 1)):
        assert out.error_from_request and out.outputs[0].finish_reason == "error"
        assert f"max_model_len={MAX_LEN}" in out.error and f"has {length} tokens" in out.error
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_llm_refuses_bad_prompts_alone(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[], {"prompt_token_ids": [1, vocab]}, {"prompt_token_ids": [1, 2.5]}, [3, 4]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert "must not be empty" in outs[0].error
    assert f"token id {vocab}, outside the vocabulary" in outs[1].error
    assert "not a token id" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 2
