"""A real server under abuse: huge prompts, request caps, slow or idle connections, client chat
templates; and the embedded model's public name and logprob bytes."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.integration.openai_server import RemoteServer
from tests.model_helpers import make_tiny_model
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

READ_TIMEOUT = 1.0
KEEP_ALIVE = 1.0
LIMIT_CONCURRENCY = 6
MAX_HEADER_BYTES = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    args = [
        str(path),
        "--served-model-name",
        "tiny",
        "--trust-request-chat-template",
        "--max-prompts-per-request",
        "4",
        "--max-request-work",
        "6",
        "--max-stop-strings",
        "2",
        "--max-stop-string-chars",
        "8",
        "--max-chat-messages",
        "4",
        "--request-read-timeout",
        str(READ_TIMEOUT),
        "--timeout-keep-alive",
        str(KEEP_ALIVE),
        "--limit-concurrency",
        str(LIMIT_CONCURRENCY),
        "--max-header-bytes",
        str(MAX_HEADER_BYTES),
    ]  # --max-request-bytes stays at its default, 8 MiB
    with RemoteServer(args) as srv:
        yield srv


def raw_connection(server: RemoteServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_health_answers_while_huge_prompts_are_refused(server):
    huge = "hello world " * (7_000_000 // 12)  # 7 MB, under the 8 MiB body limit
    requests = [
        ("/v1/completions", {"model": "tiny", "prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/embeddings", {"input": huge}),
    ] * 2
    # Encoded, and the client made (its TLS setup holds the GIL), up front: this process's own
    # work would delay the probe, not the server.
    encoded = [(path, json.dumps(body).encode()) for path, body in requests]
    statuses: list[int] = []
    sending = httpx.Client(timeout=120)
    enough = threading.Event()  # the probe has its samples: stop after the current round

    def send_huge() -> None:
        with sending:
            while not enough.is_set():
                for path, data in encoded:
                    statuses.append(sending.post(server.root + path, content=data).status_code)

    latencies = []
    sender = threading.Thread(target=send_huge)
    with httpx.Client(timeout=10) as probe:
        probe.get(f"{server.root}/health")  # connected before timing
        sender.start()
        while sender.is_alive():
            start = time.perf_counter()
            assert probe.get(f"{server.root}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            if len(latencies) >= 20:
                enough.set()
            time.sleep(0.005)  # the probe's pace: samples spread over the huge requests
    sender.join()
    assert statuses and statuses == [400] * len(statuses)
    # Each refusal still parses 7 MB of JSON on the event loop (tens of ms); tokenizing one
    # there took seconds, during which no probe was answered. The median holds /health to
    # 100 ms; the max allows one scheduling hiccup on a busy 2-core machine.
    assert len(latencies) >= 20, latencies
    assert statistics.median(latencies) < 0.1 and max(latencies) < 0.5, latencies


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a"] * 5}, "prompt"),
        ("/v1/completions", {"prompt": [[5]] * 4, "n": 2}, "n"),
        ("/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": "123456789"}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 5}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 7}, "n"),
    ],
)
def test_request_caps(server, path, body, param):
    response = httpx.post(server.root + path, json={"max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_caps_leave_requests_within_them_alone(server):
    body = {"prompt": [[5]] * 3, "n": 2, "stop": ["xy", "12345678"], "max_tokens": 2}
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 6


def test_a_request_template_runs_sandboxed_and_the_server_stays_up(server):
    chat = f"{server.base_url}/chat/completions"
    messages = [{"role": "user", "content": "hello"}]
    for template in (
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__init__.__globals__['sys'].modules }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ):
        body = {"messages": messages, "chat_template": template, "max_tokens": 2}
        response = httpx.post(chat, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template"
    assert httpx.get(f"{server.root}/health").status_code == 200
    benign = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    body = {"messages": messages, "chat_template": benign, "max_tokens": 2}
    response = httpx.post(chat, json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] > 0


def test_headers_that_do_not_arrive_in_time_get_408(server):
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        start = time.monotonic()
        answer = read_all(sock)
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert READ_TIMEOUT * 0.9 <= waited < READ_TIMEOUT + 3


def test_a_body_that_stalls_gets_408(server):
    with raw_connection(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": "'
        )
        start = time.monotonic()
        answer = read_all(sock)
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and b"x-request-id" in answer.lower()
    assert READ_TIMEOUT * 0.9 <= waited < READ_TIMEOUT + 3


def test_idle_kept_alive_connections_close(server):
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        answer = read_all(sock)  # the 200, then the close after the keep-alive timeout
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 200")
    assert KEEP_ALIVE * 0.9 <= waited < KEEP_ALIVE + 3


def test_oversized_headers_are_refused(server):
    big = {"x-filler": "a" * (MAX_HEADER_BYTES + 100)}
    response = httpx.get(f"{server.root}/health", headers=big)
    assert response.status_code == 431 and response.json()["error"]["code"] == "headers_too_large"
    small = {"x-filler": "a" * (MAX_HEADER_BYTES // 2)}
    assert httpx.get(f"{server.root}/health", headers=small).status_code == 200


def _health_status(server: RemoteServer) -> int:
    return httpx.get(f"{server.root}/health", timeout=5).status_code


def test_connections_beyond_the_limit_get_503(server):
    idle = [raw_connection(server) for _ in range(LIMIT_CONCURRENCY)]
    try:
        # 200 until the server has accepted them all, then 503
        wait_until(lambda: _health_status(server) == 503, 10, "no 503 beyond the connection limit")
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: _health_status(server) == 200, 10, "no 200 after the connections closed")


@pytest.fixture(scope="module")
def embedded_server():
    with RemoteServer(["--max-model-len", "512", "--max-num-seqs", "4"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from hybridllm.loader import default_model_path, open_model_source

    return open_model_source(default_model_path()).load_tokenizer()


def test_the_embedded_model_is_listed_by_its_short_name(embedded_server):
    models = httpx.get(f"{embedded_server.base_url}/models").json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0]["root"] == "SmolLM2-135M-Instruct"
    assert "site-packages" not in json.dumps(models)


def test_chat_logprobs_carry_each_tokens_own_bytes(embedded_server, embedded_tokenizer):
    # "â" is the byte-level stand-in for the byte 0xE2, which starts e.g. "✓": a token that is
    # only a piece of a character. Forced with a logit bias, its bytes must be [0xE2].
    piece = embedded_tokenizer.convert_tokens_to_ids("â")
    body = {
        "messages": [{"role": "user", "content": "Say a check mark."}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {str(piece): 100},
    }
    url = f"{embedded_server.base_url}/chat/completions"
    (entry,) = httpx.post(url, json=body, timeout=120).json()["choices"][0]["logprobs"]["content"]
    assert entry["bytes"] == [0xE2]
    assert entry["token"] == "\ufffd"  # the text cannot show half a character; bytes can
    assert len(entry["top_logprobs"]) == 2  # the model's own top tokens, before the bias
    for top in entry["top_logprobs"]:
        raw = bytes(top["bytes"])
        assert raw and raw.decode("utf-8", "replace") == top["token"]

    # Unforced, the bytes of all tokens together are the text's UTF-8.
    body = {
        "messages": [{"role": "user", "content": "Repeat exactly: ✓ café 日本語"}],
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
    }
    choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    content = choice["logprobs"]["content"]
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    text = choice["message"]["content"]
    if "\ufffd" not in text:  # cut inside a character by max_tokens: nothing to compare
        assert joined.decode() == text
