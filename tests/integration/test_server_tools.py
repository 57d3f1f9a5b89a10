"""Tool calling and reasoning through a real server with the official openai client.

The embedded SmolLM2 was not trained on a tool format, so the `auto` tests steer it: asked to
repeat a hermes block exactly, it copies it greedily. They prove the server path (template,
parser, response and stream shapes, finish reasons), not that the model chooses tools well;
the parsers themselves are tested on strings in tests/unit/test_tool_parsers.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.openai_server import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STEERED = [
    {"role": "system", "content": "You copy text exactly."},
    {"role": "user", "content": f"Repeat this text exactly and write nothing else:\n{CALL}"},
]
# A template that shows what it was given: tool definitions, tool calls and tool results.
TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}: {{ t.function.description }}\n"
    "{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def server():
    args = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with RemoteServer([*args, "--trust-request-chat-template"]) as s:
        yield s


def rendered(server, **body) -> str:
    """The prompt the server would run for a chat body, as text (through /tokenize)."""
    tokens = httpx.post(f"{server.root}/tokenize", json=body).raise_for_status().json()["tokens"]
    return httpx.post(f"{server.root}/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_tool_definitions_and_results_reach_the_template(server):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = rendered(server, messages=history, tools=[WEATHER], chat_template=TEMPLATE)
    assert "TOOL get_weather: Current weather of a city" in text
    assert "CALL call_1 get_weather Paris" in text  # arguments reach it as an object
    assert "tool: sunny FOR call_1" in text
    # The chat endpoint runs the same prompt, and the model's own template takes the history.
    client = server.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        max_tokens=2,
        extra_body={"chat_template": TEMPLATE},
    )
    count = httpx.post(
        f"{server.root}/tokenize",
        json={"messages": history, "tools": [WEATHER], "chat_template": TEMPLATE},
    ).json()["count"]
    assert reply.usage.prompt_tokens == count
    # Greedy: at the default temperature the model may draw its end token within 2 tokens.
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length"


def test_auto_parses_a_hermes_reply(server):
    before = server.metrics()
    reply = server.client().chat.completions.create(
        model=MODEL, messages=STEERED, tools=[WEATHER], temperature=0, max_tokens=40
    )
    after = server.metrics()
    key = 'hybridllm:tool_call_requests_total{tool_choice="auto"}'
    assert after[key] == before.get(key, 0) + 1
    calls = 'hybridllm:tool_calls_total{source="parsed"}'
    assert after[calls] == before.get(calls, 0) + 1
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_streams_tool_call_deltas(server):
    client = server.client()
    with client.chat.completions.stream(
        model=MODEL, messages=STEERED, tools=[WEATHER], temperature=0, max_tokens=40
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # tool_choice none: the same reply is text.
    reply = client.chat.completions.create(
        model=MODEL,
        messages=STEERED,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert "<tool_call>" in reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"


def test_reasoning_content(server):
    client = server.client()
    # One example turn with a think block: SmolLM2 imitates it greedily.
    steer = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>one plus one</think>Two"},
        {"role": "user", "content": "2+2?"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=steer, temperature=0, max_tokens=12
    )
    message = reply.choices[0].message
    whole = (message.reasoning_content, message.content)
    assert message.reasoning_content == "two plus two" and message.content
    assert "think>" not in message.content
    chunks = client.chat.completions.create(
        model=MODEL, messages=steer, temperature=0, max_tokens=12, stream=True
    )
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning or None, content or None) == whole
    # A reply without a think block (the usual SmolLM2 answer) is all content.
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
    )
    assert plain.choices[0].message.content and plain.choices[0].message.reasoning_content is None


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_400s(server, extra, param):
    body = {"model": MODEL, "messages": STEERED, "tools": [WEATHER], "max_tokens": 4, **extra}
    if body["tools"] is None:
        del body["tools"]
    response = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert httpx.get(f"{server.root}/health").status_code == 200


SCHEMA_TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
def test_required_and_named_tool_choices_are_enforced(server, tool_choice, stream):
    """The grammar forces a call whose arguments match the function's schema, whatever the
    model would have said (sampled, so the model's own preference does not decide it)."""
    client = server.client()
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    for seed in (1, 2):
        kwargs = dict(
            model=MODEL, messages=messages, tools=SCHEMA_TOOLS, tool_choice=tool_choice,
            temperature=0.8, seed=seed, max_tokens=80,
        )  # fmt: skip
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for delta in choice.delta.tool_calls or []:
                        call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                        call["name"] += (delta.function.name or "") if delta.function else ""
                        call["arguments"] += (
                            (delta.function.arguments or "") if delta.function else ""
                        )
            found = [calls[i] for i in sorted(calls)]
        else:
            reply = client.chat.completions.create(**kwargs).choices[0]
            finish = reply.finish_reason
            found = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in reply.message.tool_calls or []
            ]
        assert finish == "tool_calls" and found, (finish, found)
        for call in found:
            assert call["name"] in ("get_weather", "add")
            if tool_choice != "required":
                assert call["name"] == "add"
            arguments = json.loads(call["arguments"])
            if call["name"] == "add":
                assert set(arguments) == {"a", "b"}
                assert all(isinstance(v, int) for v in arguments.values())
