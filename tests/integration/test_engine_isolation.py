"""A failure that belongs to one request fails that request alone, frees its KV blocks, and
leaves the engine serving; bad parameters are refused before anything is queued."""

from __future__ import annotations

import math

import pytest

from hybridllm import LLM, SamplingParams
from tests.model_helpers import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": [3, 8, 21]}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, use_tqdm=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _assert_idle_and_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not engine.output_processor.requests


def _run(llm: LLM, bad: dict) -> list:
    """Queue the good prompts and one more request, let `bad` break it once queued."""
    engine = llm.llm_engine
    engine.add_request("good-0", PROMPTS[0], GREEDY)
    engine.add_request("victim", PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=12))
    engine.add_request("good-1", PROMPTS[1], GREEDY)
    bad["break"](engine)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _victim_params(engine):
    (child,) = engine.output_processor.child_ids("victim")
    return engine.scheduler.requests[child].sampling_params


@pytest.mark.parametrize(
    "fault",
    [
        # A request whose sampling parameters turned bad after validation (a bug upstream):
        # its metadata cannot be built; the batch samples without it.
        "logit_bias",
        # Its detokenizer raises (a broken tokenizer for one token).
        "detokenize",
    ],
)
def test_one_request_fails_alone(llm, expected, fault):
    def breaker(engine):
        if fault == "logit_bias":
            _victim_params(engine).logit_bias = {10**9: 1.0}
        else:
            _, sample = engine.output_processor.child_to_parent["victim"]

            def broken(token_ids):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

            sample.detokenizer.add_tokens = broken

    finals = _run(llm, {"break": breaker})
    why = {
        "logit_bias": "its sampling parameters failed",
        "detokenize": "internal error processing the output",
    }[fault]
    assert why in (finals["victim"].error or "")
    # its own parameters are the request's fault (a 400 on the server); a detokenizer is ours
    assert finals["victim"].error_from_request == (fault == "logit_bias")
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert finals["good-0"].error is None and finals["good-1"].error is None
    assert finals["good-0"].outputs[0].token_ids == expected[0]
    assert finals["good-1"].outputs[0].token_ids == expected[1]
    _assert_idle_and_free(llm)
    # The engine goes on serving.
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_failed_step_fails_its_requests_and_frees_their_blocks(llm, expected):
    runner = llm.llm_engine.executor.workers[0].model_runner
    original = runner.execute_model
    calls = {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # mid-generation: the requests hold KV blocks
            raise RuntimeError("injected step failure")
        return original(*args, **kwargs)

    runner.execute_model = fails_once
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        runner.execute_model = original
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    assert all("internal error in the model step" in o.error for o in outs)
    assert not any(o.error_from_request for o in outs)
    assert "injected" not in outs[0].error  # internals go to the log, not to the client
    _assert_idle_and_free(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"logit_bias": {10**12: 1.0}}, "logit_bias"),
        ({"logprobs": 10**6}, "logprobs"),
    ],
)
def test_params_outside_the_model_raise_and_queue_nothing(llm, expected, kwargs, field):
    params = [GREEDY, SamplingParams(max_tokens=4, **kwargs)]
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        llm.generate(PROMPTS, params)
    _assert_idle_and_free(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_huge_top_k_means_no_limit(llm):
    seeded = dict(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    unlimited = llm.generate(PROMPTS[:1], SamplingParams(top_k=0, **seeded))
    huge = llm.generate(PROMPTS[:1], SamplingParams(top_k=1 << 63, **seeded))
    assert huge[0].outputs[0].token_ids == unlimited[0].outputs[0].token_ids


def test_non_finite_values_are_refused():
    for field in ("temperature", "top_p", "repetition_penalty", "presence_penalty"):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
                SamplingParams(**{field: value})
