"""OpenAI's Responses API (/v1/responses) through a real server with the official client.

Greedy replies of the embedded SmolLM2 must equal the chat completion of the same
conversation, which proves the translation both ways, previous_response_id's included.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given

from tests.integration.agent_api_fuzz import (
    CITY_SCHEMA,
    FUZZ,
    MODEL,
    bodies,
    check_status,
    post,
    responses_fields,
    sse_events,
)
from tests.integration.openai_server import RemoteServer

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": CITY_SCHEMA,
}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--tool-call-parser", "hermes"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def chat(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_plain_and_instructions_match_the_chat_completion(client):
    reply = client.responses.create(
        model=MODEL, input="Name a color.", max_output_tokens=6, temperature=0
    )
    expected = chat(client, [{"role": "user", "content": "Name a color."}], 6)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == expected.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert (
        reply.usage.output_tokens == 6 and reply.usage.total_tokens == reply.usage.input_tokens + 6
    )
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    instructed = client.responses.create(
        model=MODEL,
        input=items,
        instructions="Answer in French.",
        max_output_tokens=6,
        temperature=0,
    )
    system = {"role": "system", "content": "Answer in French."}
    expected = chat(client, [system, {"role": "user", "content": "Name a color."}], 6)
    assert instructed.output_text == expected.choices[0].message.content
    assert instructed.instructions == "Answer in French."


def test_stream_matches_the_whole_reply(client):
    kwargs = dict(model=MODEL, input="Hi", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"  # SmolLM2's short greeting ends by itself
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [e.type for e in client.responses.create(**kwargs, stream=True)]
    assert events[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert events[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(events[4:-4]) == {"response.output_text.delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_and_its_output(client, stream):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            reply = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        reply = client.responses.create(**kwargs)
    assert reply.status == "completed"
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments)["city"], str)
    # The result continues the stored conversation.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=reply.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert answer.previous_response_id == reply.id and answer.output_text
    # The same conversation sent whole gives the same prompt and reply.
    explicit = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": kwargs["input"]}, call.model_dump(), result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert explicit.usage.input_tokens == answer.usage.input_tokens
    assert explicit.output_text == answer.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=5, temperature=0
    )
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0,
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    expected = chat(client, history, 5)
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == expected.choices[0].message.content
    # store=false: the response cannot be continued.
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    for unknown in ("resp_unknown", unstored.id):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="x", previous_response_id=unknown)
        assert info.value.code == "previous_response_not_found"
        assert info.value.param == "previous_response_id"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, None),
        ({"input": "x", "max_output_tokens": 1.5}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**30}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, None),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "no"}},
            None,
        ),
        ({"input": "x", "metadata": {"a": [[[[1]]]]}}, None),
        ({"input": "x", "model": "gpt-nope"}, "model"),
    ],
)
def test_bad_inputs_are_4xx_in_openais_shape(http, body, param):
    response = http.post("/responses", json=body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


@pytest.mark.parametrize(
    "raw", ['{"input": ' + "[" * 100_000 + "]" * 100_000 + "}", "[1]", '{"input": "x"', ""]
)
def test_malformed_and_deep_bodies_are_400s(http, raw):
    response = http.post("/responses", content=raw)
    assert response.status_code == 400 and response.json()["error"]["message"], response.text


def test_fuzzed_responses_never_fail_the_server(client, http):
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1).id
    fields = responses_fields(stored)
    statuses: dict[int, int] = {}

    @FUZZ
    @given(bodies(fields, {name: fields[name] for name in ("input", "max_output_tokens")}))
    def run(body):
        response = post(http, "/responses", body)
        context = check_status(response, body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            assert response.json()["error"]["message"], context
        elif body.get("stream") is True:
            names = [name for name, _ in sse_events(response.text)]
            assert names[-1] in ("response.completed", "response.incomplete"), context
            assert "error" not in names and "response.failed" not in names, context
        else:
            assert response.json()["object"] == "response", context

    run()
    assert statuses.get(200, 0) >= 5, statuses  # the fuzz reaches the engine
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).output_text
