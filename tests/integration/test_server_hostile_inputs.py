"""Hostile JSON and ids sent to a real server: each is a 400 naming the field (or, written by
the model, stays text), leaves no traceback in the server log, and the server goes on serving.

The model-side cases steer the embedded SmolLM2 as tests/integration/test_server_tools.py does:
asked to repeat a hermes block exactly, it copies it greedily (and, given a run of brackets,
keeps writing brackets).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest

from hybridllm.json_limits import MAX_JSON_DEPTH
from tests.integration.openai_server import RemoteServer
from tests.integration.test_server_tools import MODEL, WEATHER

pytestmark = pytest.mark.slow

DEEP = 100_000  # far past Python's recursion limit (1000 frames)


def ordinary_request(server) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    return httpx.post(f"{server.base_url}/completions", json=body, timeout=30)


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--tool-call-parser", "hermes"]) as s:
        assert ordinary_request(s).status_code == 200  # the first one warms the engine up
        yield s


@pytest.fixture
def unharmed(server):
    """After the test: an ordinary request is served within a couple of seconds, and the log
    has no traceback from anything the test sent."""
    start = os.path.getsize(server.log.name)
    yield
    began = time.monotonic()
    reply = ordinary_request(server)
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - began < 3
    with open(server.log.name, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        log = f.read()
    assert "Traceback" not in log and "RecursionError" not in log, log[-3000:]


def post(server, path: str, body: Any) -> httpx.Response:
    """`body` as JSON, or sent as is when it is already text (bodies json.dumps cannot write)."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.root}{path}", content=content, headers=headers, timeout=60)


def assert_refused(response: httpx.Response, param: str | None, says: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert says in error["message"], error


def deep_object(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def history(arguments: str) -> list[dict]:
    """A chat whose assistant turn called a tool with `arguments` (raw JSON text)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]


ARGS_PARAM = "messages.1.tool_calls.0.function.arguments"
DEEP_ARGUMENTS = {
    "arrays": "[" * DEEP + "]" * DEEP,
    "objects": '{"a":' * DEEP + "1" + "}" * DEEP,
    "just past the limit": '{"a": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}",
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("shape", list(DEEP_ARGUMENTS))
def test_deep_tool_call_arguments(server, unharmed, path, shape):
    body = {"model": MODEL, "messages": history(DEEP_ARGUMENTS[shape])}
    if path == "/v1/chat/completions":
        body["max_tokens"] = 1
    assert_refused(post(server, path, body), ARGS_PARAM, f"deeper than {MAX_JSON_DEPTH} levels")


def test_tool_call_arguments_as_deep_as_allowed(server, unharmed):
    arguments = '{"a": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    reply = post(server, "/tokenize", {"messages": history(arguments)})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("arguments", ['{"city": NaN}', '{"d": Infinity}', '{"d": 1e999}'])
def test_tool_call_arguments_must_be_strict_json(server, unharmed, arguments):
    assert_refused(post(server, "/tokenize", {"messages": history(arguments)}), ARGS_PARAM)


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
)
@pytest.mark.parametrize(
    "body",
    [
        "[" * DEEP + "]" * DEEP,
        '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}",
        '{"messages": [{"role": "user", "content": "x"}], "extra": '
        + '{"a":' * DEEP
        + "1"
        + "}" * DEEP
        + "}",
    ],
    ids=["body", "field", "unknown field"],
)
def test_body_too_deep_to_parse(server, unharmed, path, body):
    assert_refused(post(server, path, body), None, "nested too deep")


@pytest.mark.parametrize(
    "field,body",
    [
        (
            "chat_template_kwargs",
            {"chat_template_kwargs": {"x": deep_object(500)}},
        ),
        (
            "tools.0.function.parameters",
            {
                "tools": [{**WEATHER, "function": {"name": "f", "parameters": deep_object(500)}}],
                "tool_choice": "none",
            },
        ),
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": deep_object(500)},
                }
            },
        ),
        ("structured_outputs", {"structured_outputs": {"json": deep_object(500)}}),
    ],
)
def test_free_form_objects_are_bounded(server, unharmed, field, body):
    # 500 levels parse (FastAPI's json.loads recurses in C, to about 1000), so the
    # request reaches the template and the schema compiler unless its depth is checked.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    reply = post(server, "/v1/chat/completions", {**chat, **body})
    assert_refused(reply, field, f"deeper than {MAX_JSON_DEPTH} levels")


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [1.0]}, "tokens.0"),
        ("/detokenize", {"tokens": [1, True]}, "tokens.1"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt.0"),
        ("/v1/completions", {"prompt": [True, 2]}, "prompt.0"),
        ("/v1/completions", {"prompt": [[1, "2"]]}, "prompt.0"),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2.0]}, "stop_token_ids.0"),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [False]}, "stop_token_ids.0"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {" 1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"+1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"1_0": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"\u0661": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"9" * 5000: 5}}, "logit_bias"),
        ("/v1/embeddings", {"input": [1.0]}, "input.0"),
    ],
)
def test_token_ids_are_integers(server, unharmed, path, body, param):
    if path == "/v1/completions":
        body = {**body, "max_tokens": 1}
    assert_refused(post(server, path, {"model": MODEL, **body}), param)


def test_token_ids_still_accepted(server, unharmed):
    ids = post(server, "/tokenize", {"prompt": "Hi there"}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hi there"}
    body = {"prompt": ids, "max_tokens": 1, "stop_token_ids": [2], "logit_bias": {"0": -100}}
    assert post(server, "/v1/completions", body).status_code == 200


def test_tokenize_takes_messages_or_prompt_not_both(server, unharmed):
    body = {"messages": [{"role": "user", "content": "Hi"}], "prompt": "something else"}
    assert_refused(post(server, "/tokenize", body), "prompt", "not both")


# ---- what the model writes ----


def steered(block: str) -> list[dict]:
    return [
        {"role": "system", "content": "You copy text exactly."},
        {"role": "user", "content": f"Repeat this text exactly and write nothing else:\n{block}"},
    ]


def chat(server, messages: list[dict], max_tokens: int, stream: bool) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish reason) of a greedy reply with WEATHER offered,
    whole or put together from the streamed deltas."""
    client = server.client(timeout=600)
    body = dict(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=max_tokens
    )
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, pieces, reason = "", {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            name, arguments = pieces.get(piece.index, ("", ""))
            function = piece.function
            pieces[piece.index] = (
                name + (function.name or "" if function else ""),
                arguments + (function.arguments or "" if function else ""),
            )
        reason = chunk.choices[0].finish_reason or reason
    return content, [pieces[i] for i in sorted(pieces)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "block",
    [
        '{"name": "get_time", "arguments": {"city": "Paris"}}',  # a function not offered
        '{"name": "get_weather", "arguments": {"days": NaN}}',  # not JSON
    ],
    ids=["unknown function", "NaN"],
)
def test_model_calls_that_are_not_calls_stay_text(server, unharmed, block, stream):
    written = f"<tool_call>\n{block}\n</tool_call>"
    content, calls, reason = chat(server, steered(written), 40, stream)
    assert calls == [] and reason in ("stop", "length")
    assert written in content  # the model did write the block
    # The same steering with a call to the offered function is a call: the parser is on.
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls, reason = chat(server, steered(good), 40, stream)
    assert calls == [("get_weather", '{"city": "Paris"}')] and reason == "tool_calls"


def test_model_output_nested_too_deep_stays_text(server, unharmed):
    start = '<tool_call>\n{"name": "get_weather", "arguments": {"a": '
    block = start + "[" * 20 + "]" * 20 + "}}\n</tool_call>"
    # Copying a run of brackets, the model keeps writing "[[" tokens until max_tokens: an
    # unclosed block far deeper than Python's recursion limit once parsed.
    content, calls, reason = chat(server, steered(block), 600, stream=False)
    assert calls == [] and reason == "length"
    assert content.startswith(start) and content.count("[") > 4 * MAX_JSON_DEPTH
