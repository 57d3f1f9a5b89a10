"""The Messages and Responses APIs over a scripted engine: x-api-key, errors after the 200."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hybridllm.entrypoints.openai.api_server import ServerOptions, build_app
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.serving_base import ServedModel
from tests.model_helpers import make_tiny_tokenizer
from tests.unit.scripted_engine import ScriptedEngine

MODEL = ServedModel(names=("scripted",), path="/models/scripted", max_model_len=64, vocab_size=400)
MESSAGES = {"model": "scripted", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "scripted", "max_output_tokens": 2, "input": "hi"}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(400)


def make_client(engine: ScriptedEngine, tokenizer, **options) -> TestClient:
    app = build_app(AsyncEngine(engine), tokenizer, MODEL, ServerOptions(**options))
    return TestClient(app, raise_server_exceptions=False)


def events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in filter(None, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_x_api_key_is_accepted_as_the_api_key(tokenizer):
    with make_client(ScriptedEngine(), tokenizer, api_key="k") as http:
        assert http.post("/v1/messages", json=MESSAGES).status_code == 401
        wrong = http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and "x-api-key" in wrong.json()["error"]["message"]
        # A right key in one header does not let a wrong one in the other fail the request.
        both = {"x-api-key": "k", "Authorization": "Bearer nope"}
        reply = http.post("/v1/messages", json=MESSAGES, headers=both)
        assert reply.status_code == 200 and reply.json()["content"][0]["text"] == "t1 t2 "
        assert http.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
        bearer = {"Authorization": "Bearer k"}
        assert http.post("/v1/responses", json=RESPONSES, headers=bearer).status_code == 200


def test_messages_stream_ends_with_an_error_event_when_the_engine_dies(tokenizer):
    with make_client(ScriptedEngine(fail_at_step=3), tokenizer) as http:
        body = {**MESSAGES, "max_tokens": 20, "stream": True}
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 200
        stream = events(response.text)
        names = [name for name, _ in stream]
        assert names[:3] == ["message_start", "ping", "content_block_start"]
        assert names[-1] == "error" and "message_stop" not in names
        error = stream[-1][1]
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert error["error"]["message"].startswith("the engine is not running")
        # Refused before any stream once the engine is dead: a 503 in Anthropic's shape.
        again = http.post("/v1/messages", json=body)
        assert again.status_code == 503 and again.json()["error"]["type"] == "api_error"


def test_responses_stream_ends_failed_when_the_engine_dies(tokenizer):
    with make_client(ScriptedEngine(fail_at_step=3), tokenizer) as http:
        response = http.post(
            "/v1/responses", json={**RESPONSES, "max_output_tokens": 20, "stream": True}
        )
        assert response.status_code == 200
        stream = events(response.text)
        names = [name for name, _ in stream]
        assert names[:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert names[-2:] == ["error", "response.failed"]
        assert stream[-2][1]["code"] == "engine_dead"
        failed = stream[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "engine_dead"
        assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
