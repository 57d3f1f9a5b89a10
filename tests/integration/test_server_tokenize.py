"""/tokenize and /detokenize on a real server: vLLM's shapes, round trips and refusals."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.openai_server import RemoteServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-chat-messages", "4", "--max-model-len", "256"]) as s:
        yield s


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.root}{path}", json=body, timeout=30)


def test_round_trip(server):
    text = "Hello, world! Ünïcödé ✓"
    out = post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == 256
    assert len(body["token_strs"]) == body["count"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    plain = post(server, "/tokenize", {"prompt": text}).json()
    assert "token_strs" not in plain and plain["tokens"] == body["tokens"]


def test_chat_form_counts_what_chat_runs(server):
    messages = [{"role": "user", "content": "Name a prime."}]
    body = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert body["count"] == reply.usage.prompt_tokens
    text = post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert "Name a prime." in text and text.rstrip().endswith("assistant")
    no_prompt = post(
        server, "/tokenize", {"messages": messages, "add_generation_prompt": False}
    ).json()
    assert no_prompt["count"] < body["count"]


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * 257}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", [1, 2], 400, None),
        ("/tokenize", {"prompt": "x" * 10_000_000}, 413, None),
        ("/tokenize", {"prompt": "word " * 200_000}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 5}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        (
            "/tokenize",
            {"messages": [{"role": "user"}], "chat_template": "{{ x }}"},
            400,
            "chat_template",
        ),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ],
)
def test_refusals_name_the_field(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert httpx.get(f"{server.root}/health").status_code == 200
