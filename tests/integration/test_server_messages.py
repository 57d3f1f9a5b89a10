"""Anthropic's Messages API (/v1/messages) through a real server with the official client.

The embedded SmolLM2 answers greedily, so a Messages reply must equal the chat completion of
the same conversation: that proves the translation both ways. Tool use is steered as in
test_server_tools.py (auto: the model copies a hermes block) or forced (tool_choice tool).
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from hypothesis import given

from tests.integration.agent_api_fuzz import (
    CITY_SCHEMA,
    FUZZ,
    MESSAGES_FIELDS,
    MODEL,
    bodies,
    check_status,
    post,
    sse_events,
)
from tests.integration.openai_server import RemoteServer

pytestmark = pytest.mark.slow

API_KEY = "messages-key"
GREEDY = {"temperature": 0}  # this client version has no sampling arguments: extra_body
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": CITY_SCHEMA,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEER = f"Repeat this text exactly and write nothing else:\n{CALL}"


@pytest.fixture(scope="module")
def server():
    args = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", API_KEY]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.root, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.root, headers={"x-api-key": API_KEY}, timeout=60) as c:
        yield c


def test_create_matches_the_chat_completion(client, http):
    system = [{"type": "text", "text": "You are terse."}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    reply = client.messages.create(
        model=MODEL, max_tokens=6, system=system, messages=messages, extra_body=GREEDY
    )
    history = [{"role": "system", "content": "You are terse."}, *messages]
    body = {"messages": history, "max_tokens": 6, **GREEDY}
    chat = http.post("/v1/chat/completions", json=body).raise_for_status().json()
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat["choices"][0]["message"]["content"]
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert reply.usage.output_tokens == 6
    count = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert count.input_tokens == reply.usage.input_tokens


def test_stop_sequence_and_end_turn(client):
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=messages, extra_body=GREEDY)
    text = whole.content[0].text
    assert whole.stop_reason == "end_turn", whole  # SmolLM2's short greeting ends by itself
    word = text.split()[1]
    cut = client.messages.create(
        model=MODEL, max_tokens=16, messages=messages, stop_sequences=[word], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]


def test_streams_match_the_whole_reply(client):
    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    whole = client.messages.create(**kwargs, extra_body=GREEDY)
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens
    events = [e.type for e in client.messages.create(**kwargs, stream=True, extra_body=GREEDY)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_round_trip(client, stream):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(
        model=MODEL,
        max_tokens=40,
        messages=[question],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    assert reply.stop_reason == "tool_use", reply
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 degrees"}
    history = [question, {"role": "assistant", "content": reply.content}]
    answer = client.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[WEATHER],
        messages=[*history, {"role": "user", "content": [result]}],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].text
    # The result reaches the prompt: a longer result is more tokens.
    longer = {**result, "content": [{"type": "text", "text": "sunny, 24 degrees, light wind"}]}
    counts = [
        client.messages.count_tokens(
            model=MODEL, tools=[WEATHER], messages=[*history, {"role": "user", "content": [r]}]
        ).input_tokens
        for r in (result, longer)
    ]
    assert counts[0] == answer.usage.input_tokens and counts[1] > counts[0]


def test_auto_tool_use_through_the_hermes_parser(client):
    kwargs = dict(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        extra_body=GREEDY,
        system="You copy text exactly.",
        messages=[{"role": "user", "content": STEER}],
    )
    reply = client.messages.create(**kwargs)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    assert reply.content[0].input == {"city": "Paris"}
    events = list(client.messages.create(**kwargs, stream=True))
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]


def test_reasoning_comes_back_as_a_thinking_block(client):
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>one plus one</think>Two"},
        {"role": "user", "content": "2+2?"},
    ]
    kwargs = dict(model=MODEL, max_tokens=12, messages=messages, extra_body=GREEDY)
    reply = client.messages.create(**kwargs)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == "two plus two"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(reply)


def blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_client_disconnect_aborts_the_request(server, http):
    """Streamed or not, a client that leaves stops its generation (the chat path's aborts)."""
    aborted = 'hybridllm:request_success_total{finished_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    story = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
    body = {"model": MODEL, "max_tokens": 1000, "messages": story, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if "content_block_delta" in line:
                break  # leaving the block closes the connection mid-stream
    with pytest.raises(httpx.TimeoutException):
        http.post("/v1/messages", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics.get(aborted, 0) == before + 2 and not metrics["hybridllm:num_requests_running"]:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"requests not aborted: {metrics}")


def test_the_api_key_is_required(server):
    wrong = anthropic.Anthropic(base_url=server.root, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    bearer = anthropic.Anthropic(base_url=server.root, auth_token=API_KEY, max_retries=0)
    count = bearer.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert count.input_tokens > 0


OK_MESSAGES = [{"role": "user", "content": "Hi"}]


def bad(**fields) -> dict:
    """A good body with `fields` changed (a None value: left out)."""
    body = {"model": MODEL, "max_tokens": 2, "messages": OK_MESSAGES, **fields}
    return {key: value for key, value in body.items() if value is not None}


BAD_BODIES = [
    bad(max_tokens=None),
    bad(messages=[{"role": "system", "content": "x"}]),
    bad(messages=[{"role": "tool", "content": "x"}]),
    bad(max_tokens=1.5),
    bad(max_tokens="8"),
    bad(max_tokens=0),
    bad(max_tokens=10**30),
    bad(messages=[]),
    bad(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
    bad(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
    bad(tools=[{"name": "bad name!"}]),
    bad(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
    bad(metadata={"user_id": [[[[1]]]]}),
    bad(temperature=-1),
    bad(stop_sequences=["x"] * 100),
]
RAW_BAD_BODIES = [
    '{"model": "m", "max_tokens": 2, "messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"model": "m", "max_tokens": 2, "metadata": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}",
    '{"model": "m", "max_tokens": ' + "9" * 5000 + ', "messages": []}',
    "[1, 2]",
    "{not json",
]


def test_bad_inputs_are_400s_in_anthropics_shape(server, client, http):
    cases = [("/v1/messages", body) for body in BAD_BODIES + RAW_BAD_BODIES]
    cases.append(("/v1/messages/count_tokens", {"model": MODEL}))
    for path, body in cases:
        raw = isinstance(body, str)
        response = http.post(path, **({"content": body} if raw else {"json": body}))
        assert response.status_code == 400, (str(body)[:80], response.text)
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "system", "content": "x"}]
        )
    assert "role" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=2, messages=OK_MESSAGES)
    # The server still serves.
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=OK_MESSAGES)
    assert reply.usage.output_tokens >= 1


def test_fuzzed_messages_never_fail_the_server(client, http):
    statuses: dict[int, int] = {}
    required = {name: MESSAGES_FIELDS[name] for name in ("model", "max_tokens", "messages")}

    @FUZZ
    @given(bodies(MESSAGES_FIELDS, required))
    def run(body):
        response = post(http, "/v1/messages", body)
        context = check_status(response, body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            error = response.json()
            assert error["type"] == "error" and error["error"]["message"], context
        elif body.get("stream") is True:
            events = sse_events(response.text)
            assert [name for name, _ in events][-1] == "message_stop", context
            assert all(name != "error" for name, _ in events), context
        else:
            assert response.json()["type"] == "message", context

    run()
    assert statuses.get(200, 0) >= 5, statuses  # the fuzz reaches the engine
    assert client.messages.create(model=MODEL, max_tokens=2, messages=OK_MESSAGES).content
