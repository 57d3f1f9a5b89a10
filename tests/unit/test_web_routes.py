"""The page's routes over a scripted engine: assets, --no-ui, the key on /v1/plan and /v1/live."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridllm.entrypoints.openai.api_server import ServerOptions, build_app
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.serving_base import ServedModel
from tests.model_helpers import make_tiny_tokenizer
from tests.unit.scripted_engine import ScriptedEngine
from tests.waiting import wait_until

MODEL = ServedModel(names=("scripted",), path="/models/scripted", max_model_len=64, vocab_size=400)
REPORT = {"version": 1, "text": "plan for scripted", "model": {"path": "/models/scripted"}}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(400)


def make_client(tokenizer, plan_report=None, **options) -> TestClient:
    app = build_app(
        AsyncEngine(ScriptedEngine()), tokenizer, MODEL, ServerOptions(**options),
        plan_report=plan_report,
    )  # fmt: skip
    return TestClient(app, raise_server_exceptions=False)


def test_page_and_assets_are_served_with_a_strict_policy(tokenizer):
    with make_client(tokenizer) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src" not in page.headers["content-security-policy"]  # default-src 'self'
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/ui/app.js">' in page.text
        script = http.get("/ui/app.js")
        assert script.status_code == 200 and "text/javascript" in script.headers["content-type"]
        assert http.get("/ui/style.css").status_code == 200
        for name in ("index.html", "..%2Fapi_server.py", "%2e%2e", "app.js.map"):
            assert http.get(f"/ui/{name}").status_code == 404, name


def test_no_ui_serves_no_page_but_keeps_the_data_routes(tokenizer):
    with make_client(tokenizer, ui=False) as http:
        assert http.get("/").status_code == 404
        assert http.get("/ui/app.js").status_code == 404
        assert http.get("/v1/live").status_code == 200


def test_plan_formats_and_errors(tokenizer):
    calls = []

    def report():
        calls.append(1)
        return REPORT

    with make_client(tokenizer, plan_report=report) as http:
        assert http.get("/v1/plan").json() == REPORT
        assert http.get("/v1/plan?format=text").text == "plan for scripted"
        bad = http.get("/v1/plan?format=<pdf>")
        assert bad.status_code == 400 and "format must be" in bad.json()["error"]["message"]
    assert calls == [1]  # computed once, however often it is asked for
    with make_client(tokenizer) as http:
        missing = http.get("/v1/plan")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "no_plan"


def test_live_points_arrive_and_bad_windows_are_refused(tokenizer):
    with make_client(tokenizer) as http:
        wait_until(lambda: http.get("/v1/live").json()["points"], 10, "no live point sampled")
        live = http.get("/v1/live?since=60").json()
        assert live["engine_healthy"] is True
        assert live["points"][-1]["running"] == 0 and live["points"][-1]["t"] <= 0
        for since in ("0", "-5", "1e9", "nan", "abc"):
            assert http.get(f"/v1/live?since={since}").status_code in (400, 422), since


def test_data_routes_want_the_key_and_the_page_does_not(tokenizer):
    with make_client(tokenizer, plan_report=lambda: REPORT, api_key="k") as http:
        assert http.get("/").status_code == 200  # the page holds no data: it asks for the key
        for path in ("/v1/plan", "/v1/live"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
