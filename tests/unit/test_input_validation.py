"""The one validator of prompts and sampling parameters, and the layers that use it: the
scheduler and the server refuse the same requests, at the same context boundary."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridllm.config import CacheConfig, SchedulerConfig
from hybridllm.engine.errors import EngineDeadError
from hybridllm.engine.input_validation import InputValidator, InvalidInputError
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler import Scheduler
from hybridllm.entrypoints.openai import errors as server_errors
from hybridllm.entrypoints.openai.api_server import ServerOptions, build_app
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.errors import from_value_error
from hybridllm.entrypoints.openai.serving_base import ServedModel
from hybridllm.executor import executor
from hybridllm.sampling_params import SamplingParams
from tests.unit.scripted_engine import ScriptedEngine

MAX_LEN = 32
VOCAB = 400
VALIDATOR = InputValidator(MAX_LEN, VOCAB)
BOUNDARY = [(MAX_LEN - 1, True), (MAX_LEN, False), (MAX_LEN + 1, False)]  # (length, fits)
MODEL = ServedModel(names=("m",), path="/models/m", max_model_len=MAX_LEN, vocab_size=VOCAB)


def make_scheduler(validator: InputValidator | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=MAX_LEN)
    return Scheduler(config, CacheConfig(block_size=4), 64, validator)


@pytest.mark.parametrize(("length", "fits"), BOUNDARY)
def test_a_prompt_leaves_room_for_one_output_token(length, fits):
    if fits:
        VALIDATOR.check_prompt([1] * length)
        assert VALIDATOR.output_budget(length, None) == 1
        return
    with pytest.raises(InvalidInputError, match=f"max_model_len={MAX_LEN}") as info:
        VALIDATOR.check_prompt([1] * length, "messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    assert f"the messages has {length} tokens" in str(info.value)


@pytest.mark.parametrize(
    ("token_ids", "words"),
    [
        ([], "prompt must not be empty"),
        ([1, VOCAB], f"prompt has token id {VOCAB}, outside the vocabulary [0, {VOCAB})"),
        ([-1], "prompt has token id -1, outside the vocabulary"),
        ([1, True], "prompt has True, which is not a token id"),
        ([1, 2.0], "prompt has 2.0, which is not a token id"),
    ],
)
def test_bad_prompts_are_value_errors_naming_the_field(token_ids, words):
    with pytest.raises(ValueError) as info:
        VALIDATOR.check_prompt(token_ids)
    assert words in str(info.value) and info.value.param == "prompt"


def test_without_a_vocabulary_only_the_type_and_sign_of_ids_are_checked():
    validator = InputValidator(MAX_LEN)
    validator.check_prompt([10**9])
    with pytest.raises(InvalidInputError, match="negative"):
        validator.check_prompt([-3])
    params = SamplingParams(stop_token_ids=[10**9])
    assert validator.check_params(params) is params


def test_output_budget():
    assert VALIDATOR.output_budget(10, None) == MAX_LEN - 10
    assert VALIDATOR.output_budget(10, MAX_LEN - 10) == MAX_LEN - 10
    with pytest.raises(InvalidInputError, match="lower max_completion_tokens") as info:
        VALIDATOR.output_budget(10, MAX_LEN - 9, "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    assert f"{MAX_LEN + 1} were requested" in str(info.value)


def test_params_are_checked_against_the_vocabulary():
    with pytest.raises(ValueError, match="SamplingParams.stop_token_ids"):
        VALIDATOR.check_params(SamplingParams(stop_token_ids=[VOCAB]))
    assert VALIDATOR.check_params(SamplingParams(top_k=VOCAB)).top_k == 0
    with pytest.raises(TypeError, match="SamplingParams"):
        VALIDATOR.check_params({"temperature": 0})  # type: ignore[arg-type]
    params = VALIDATOR.check_request([1, 2], SamplingParams(top_k=10**6))
    assert params.top_k == 0


def test_the_server_answers_a_400_with_the_validators_words():
    error = from_value_error(InvalidInputError("too long", "input", "context_length_exceeded"))
    assert (error.status, error.param, error.code) == (400, "input", "context_length_exceeded")
    error = from_value_error(ValueError("SamplingParams.top_p must be in (0, 1], got 2"))
    assert (error.status, error.param, error.code) == (400, "top_p", None)


@pytest.mark.parametrize(("length", "fits"), BOUNDARY)
def test_the_server_boundary(length, fits):
    engine = ScriptedEngine()
    app = build_app(AsyncEngine(engine), None, MODEL, ServerOptions())
    with TestClient(app, raise_server_exceptions=False) as http:
        body = {"prompt": [1] * length, "max_tokens": 1}
        response = http.post("/v1/completions", json=body)
        embedding = http.post("/v1/embeddings", json={"input": [1] * length})
    if fits:
        assert response.status_code == 200, response.text
        assert engine.requests == {} and embedding.status_code == 200
        assert len(response.json()["choices"][0]["text"].split()) == 1
        return
    for reply, param in ((response, "prompt"), (embedding, "input")):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["code"] == "context_length_exceeded"
        assert f"max_model_len={MAX_LEN}" in error["message"]
    assert engine.num_steps == 0


@pytest.mark.parametrize(("length", "fits"), BOUNDARY)
def test_the_scheduler_boundary(length, fits):
    scheduler = make_scheduler()
    request = Request("r", [1] * length, SamplingParams(max_tokens=None, ignore_eos=True), 0)
    scheduler.add_request(request)
    if fits:
        assert request.status == RequestStatus.WAITING
        return
    assert request.status == RequestStatus.FINISHED_ERROR and request.error_from_request
    assert f"max_model_len={MAX_LEN}" in request.error
    assert scheduler.update_from_output(scheduler.schedule()) == [request]  # reported once


def test_an_unchecked_request_fails_alone_in_the_scheduler():
    """Added to the scheduler directly, past the engine's checks: it finishes with an error
    at admission, the others run."""
    scheduler = make_scheduler(VALIDATOR)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    good = Request("good", [1, 2, 3], params, 0)
    outside = Request("outside", [1, VOCAB + 5], params, 0)
    bad_stop = Request("stop", [1, 2], SamplingParams(stop_token_ids=[VOCAB]), 0)
    wide_top_k = Request("top_k", [1, 2], SamplingParams(top_k=10**6), 0)
    for request in (good, outside, bad_stop, wide_top_k):
        scheduler.add_request(request)
    assert outside.status == bad_stop.status == RequestStatus.FINISHED_ERROR
    assert "outside the vocabulary" in outside.error and "stop_token_ids" in bad_stop.error
    assert wide_top_k.sampling_params.top_k == 0  # what the sampler can hold
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"good", "top_k"}


def test_there_is_one_engine_dead_error():
    assert executor.EngineDeadError is server_errors.EngineDeadError is EngineDeadError
