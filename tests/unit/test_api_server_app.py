"""The FastAPI app over a scripted engine: engine death turns /health and requests into 503."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hybridllm.entrypoints.openai.api_server import ServerOptions, build_app
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.serving_base import ServedModel
from tests.unit.scripted_engine import ScriptedEngine

MODEL = ServedModel(names=("scripted",), path="/models/scripted", max_model_len=64, vocab_size=100)


def make_client(engine: ScriptedEngine, **options) -> TestClient:
    # Token-id prompts only, so no tokenizer is needed.
    app = build_app(AsyncEngine(engine), None, MODEL, ServerOptions(**options))
    return TestClient(app)


def test_completion_over_the_engine_thread():
    with make_client(ScriptedEngine()) as http:
        body = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 3}
        result = http.post("/v1/completions", json=body).json()
        assert result["choices"][0]["text"] == "t1 t2 t3 "
        assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        lines = http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
        data = [line for line in lines if line.startswith("data:")]
        assert data[-1] == "data: [DONE]" and len(data) == 4  # three tokens, one chunk each


def test_a_json_body_labelled_as_a_form_is_read_as_json():
    """What `curl -d '{...}'` sends; a body that is not JSON is still a 400 saying so."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    with make_client(ScriptedEngine()) as http:
        body = '{"model": "scripted", "prompt": [1, 2], "max_tokens": 2}'
        response = http.post("/v1/completions", content=body, headers=form)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "t1 t2 "
        response = http.post("/v1/completions", content="prompt=hi", headers=form)
        assert response.status_code == 400
        assert "JSON" in response.json()["error"]["message"]


def test_engine_death_is_503_everywhere():
    engine = ScriptedEngine(fail_at_step=2)
    with make_client(engine) as http:
        assert http.get("/health").status_code == 200
        response = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 50})
        assert response.status_code == 503
        assert "simulated worker crash" in response.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        again = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 5})
        assert again.status_code == 503
        metrics = http.get("/metrics").text
        assert "hybridllm:engine_healthy 0.0" in metrics
        assert 'hybridllm:request_success_total{finished_reason="error"} 1.0' in metrics
    assert engine.shut_down


def test_streaming_request_gets_an_error_event_when_the_engine_dies():
    with make_client(ScriptedEngine(fail_at_step=3)) as http:
        response = http.post(
            "/v1/completions", json={"prompt": [1], "max_tokens": 50, "stream": True}
        )
        assert response.status_code == 200
        data = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert '"engine_dead"' in data[-2] and data[-1] == "data: [DONE]"


def test_api_key_and_body_limit():
    with make_client(ScriptedEngine(), api_key="k", max_request_bytes=2048) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = http.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert ok.json()["data"][0]["id"] == "scripted"
        big = http.post(
            "/v1/completions", headers={"Authorization": "Bearer k"}, json={"prompt": [1] * 2000}
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert http.get("/health").status_code == 200  # no key needed


def test_server_flags_make_the_server_options(monkeypatch):
    from hybridllm.entrypoints.cli import build_parser
    from hybridllm.entrypoints.openai.server_args import server_options_from_args

    monkeypatch.setenv("HYBRIDLLM_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--port", "9001", "--limit-concurrency", "7"])
    options = server_options_from_args(args)
    assert (options.port, options.limit_concurrency, options.api_key) == (9001, 7, "from-env")
    assert options.host == ServerOptions.host and options.pooling == ServerOptions.pooling
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert server_options_from_args(args).api_key == "flag"  # the flag wins
    monkeypatch.delenv("HYBRIDLLM_API_KEY")
    assert server_options_from_args(build_parser().parse_args(["serve"])).api_key is None
