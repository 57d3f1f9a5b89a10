"""Server with an API key, custom model names, mean pooling; ends with a graceful SIGTERM."""

from __future__ import annotations

import math
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.integration.openai_server import RemoteServer

pytestmark = pytest.mark.slow

API_KEY = "sekret-key"


@pytest.fixture(scope="module")
def server():
    args = [
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "alias",
        "--pooling",
        "mean",
        "--shutdown-timeout",
        "10",
    ]
    # The key comes from the environment, the documented alternative to --api-key.
    with RemoteServer(args, env={"HYBRIDLLM_API_KEY": API_KEY}) as srv:
        yield srv


def test_requests_without_the_key_are_refused(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    response = httpx.post(f"{server.base_url}/completions", json={"prompt": "x"})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    # Health, metrics and version stay open for probes and scrapers.
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert httpx.get(f"{server.root}/metrics").status_code == 200
    assert httpx.get(f"{server.root}/version").status_code == 200


def test_requests_with_the_key_succeed_under_the_served_names(server):
    client = server.client(api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
    result = client.completions.create(model="alias", prompt="Hi", max_tokens=3, temperature=0)
    assert result.model == "tiny" and result.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="SmolLM2", prompt="Hi", max_tokens=3)
    assert info.value.body["code"] == "model_not_found"


def test_mean_pooled_embeddings_are_normalized(server):
    client = server.client(api_key=API_KEY)
    result = client.embeddings.create(model="tiny", input="mean pooling", encoding_format="float")
    vector = result.data[0].embedding
    assert math.sqrt(sum(x * x for x in vector)) == pytest.approx(1.0, abs=1e-4)


def test_access_log_has_one_line_per_request(server):
    httpx.get(f"{server.root}/v1/models")  # 401: no key
    time.sleep(0.2)
    log = server.log_tail(200_000)
    assert '"GET /v1/models" 401' in log
    assert '"POST /v1/completions" 200' in log and " ms" in log


def _stream(server, max_tokens: int, events: list, first_chunk: threading.Event) -> None:
    body = {
        "model": "tiny",
        "prompt": "Tell me a story",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.stream(
            "POST", f"{server.base_url}/completions", json=body, headers=headers, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    first_chunk.set()
    except httpx.HTTPError as exc:
        events.append(f"closed: {type(exc).__name__}")
    first_chunk.set()


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits(server):
    short, long = [], []
    short_started, long_started = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=_stream, args=(server, 6, short, short_started)),
        threading.Thread(target=_stream, args=(server, 4000, long, long_started)),
    ]
    for t in threads:
        t.start()
    assert short_started.wait(30) and long_started.wait(30)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # the listening socket is closed: new work is refused
        httpx.get(f"{server.root}/health", timeout=2)
    for t in threads:
        t.join(60)
    # uvicorn re-raises the captured SIGTERM after its clean shutdown, so -SIGTERM is normal.
    assert server.proc.wait(30) in (0, -signal.SIGTERM)
    elapsed = time.monotonic() - start
    # The short stream ran to its end; the long one was cut at the 10 s shutdown timeout
    # (margins wide enough for a loaded 2-core machine).
    assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2]
    assert not any('"finish_reason":"length"' in e for e in long)
    assert elapsed < 30
    log = server.log_tail()
    assert "engine stopped" in log and "Application shutdown complete" in log
