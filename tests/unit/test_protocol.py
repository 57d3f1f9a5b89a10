"""OpenAI request models -> SamplingParams, and validation failures -> OpenAI-style 400 bodies."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridllm.entrypoints.openai.errors import OpenAIError, install_error_handlers
from hybridllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)

VOCAB = 1000


def test_completion_request_maps_to_sampling_params():
    request = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "max_tokens": 7,
            "stop": "END",
            "seed": 3,
            "logprobs": 2,
            "n": 2,
            "top_k": -1,
            "logit_bias": {"5": -100, "7": 2.5},
            "ignore_eos": True,
            "min_p": 0.1,
            "unknown_field": "ignored",
        }
    )
    params = request.to_sampling_params(request.max_tokens, VOCAB)
    assert params.max_tokens == 7 and params.stop == ["END"] and params.seed == 3
    assert params.logprobs == 2 and params.n == 2 and params.top_k == 0
    assert params.logit_bias == {5: -100.0, 7: 2.5}
    assert params.ignore_eos and params.min_p == 0.1
    assert params.temperature == 1.0 and params.top_p == 1.0  # OpenAI's defaults
    assert params.prompt_logprobs is None


def test_nulls_mean_defaults():
    request = CompletionRequest.model_validate(
        {
            "prompt": [1, 2],
            "n": None,
            "temperature": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "max_tokens": None,
        }
    )
    params = request.to_sampling_params(5, VOCAB)
    assert (params.n, params.temperature, params.presence_penalty) == (1, 1.0, 0.0)


def test_prompt_shapes():
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_chat_request_fields():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                },
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 100,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    assert request.requested_max_tokens == 9  # the newer field wins
    assert request.messages[0].text() == "be brief"
    params = request.to_sampling_params(request.requested_max_tokens, VOCAB)
    assert params.logprobs == 4 and params.max_tokens == 9
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert plain.to_sampling_params(None, VOCAB).logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(fields, param):
    request = CompletionRequest.model_validate({"prompt": "x", **fields})
    with pytest.raises(OpenAIError) as info:
        request.to_sampling_params(request.max_tokens, VOCAB)
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message or param == "n"


def test_chat_top_logprobs_needs_logprobs():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    with pytest.raises(OpenAIError) as info:
        request.to_sampling_params(None, VOCAB)
    assert info.value.param == "top_logprobs"


@pytest.fixture(scope="module")
def http():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/c")
    async def complete(request: CompletionRequest):
        return {"ok": True}

    @app.post("/e")
    async def embed(request: EmbeddingRequest):
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/c", '{"prompt": ', None, "malformed JSON"),
        ("/c", "[]", None, "JSON object"),
        ("/c", "{}", "prompt", "missing required field 'prompt'"),
        ("/c", '{"prompt": 5}', "prompt", "invalid value for 'prompt'"),
        ("/c", '{"prompt": "x", "max_tokens": "many"}', "max_tokens", "integer"),
        ("/c", '{"prompt": "x", "stream": "perhaps"}', "stream", "boolean"),
        ("/e", '{"input": "x", "encoding_format": "hex"}', "encoding_format", "float"),
    ],
)
def test_validation_errors_are_openai_bodies(http, path, body, param, words):
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


def test_routing_and_unexpected_errors_are_openai_bodies(http):
    assert http.get("/nope").json()["error"]["code"] == "not_found"
    response = http.get("/c")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    response = http.get("/boom")
    assert response.status_code == 500
    # The exception text stays in the log; the client gets a request id to quote.
    message = response.json()["error"]["message"]
    assert "kaput" not in message and "RuntimeError" not in message
    assert message.startswith("internal error")
    assert response.json()["error"]["type"] == "server_error"
