"""Anthropic and Responses requests as the chat messages they run as."""

from __future__ import annotations

import pytest

from hybridllm.entrypoints.openai.anthropic_protocol import (
    MessagesRequest,
    chat_body,
    chat_messages,
    stop_reason,
)
from hybridllm.entrypoints.openai.chat_bridge import check_depth, validate
from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages


def anthropic(messages: list[dict], **fields) -> MessagesRequest:
    return validate(
        MessagesRequest, {"model": "m", "max_tokens": 4, "messages": messages, **fields}
    )


def test_anthropic_tool_use_and_results_become_tool_calls_and_tool_messages():
    request = anthropic(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
    )
    call = {
        "id": "t1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
    }
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_anthropic_choices_and_sampling_fields_map_to_chat_fields():
    request = anthropic(
        [{"role": "user", "content": "x"}],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
        stop_sequences=["END"],
        top_k=5,
        metadata={"user_id": "u"},
    )
    body = chat_body(request)
    assert body["tool_choice"] == "required" and body["tools"][0]["function"]["name"] == "w"
    assert (body["stop"], body["top_k"], body["user"], body["max_tokens"]) == (["END"], 5, "u", 4)
    named = chat_body(
        anthropic([{"role": "user", "content": "x"}], tool_choice={"type": "tool", "name": "w"})
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "w"}}


@pytest.mark.parametrize(
    "finish,stop,expected",
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 2, ("end_turn", None)),  # an EOS token id
        ("stop", "END", ("stop_sequence", "END")),
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
    ],
)
def test_anthropic_stop_reasons(finish, stop, expected):
    assert stop_reason(finish, stop) == expected


@pytest.mark.parametrize(
    "block,role",
    [
        ({"type": "tool_use", "id": "t", "name": "w", "input": {}}, "user"),
        ({"type": "tool_result", "tool_use_id": "t"}, "assistant"),
        ({"type": "thinking", "thinking": "x"}, "user"),
    ],
)
def test_anthropic_blocks_in_the_wrong_role_are_400s(block, role):
    with pytest.raises(OpenAIError) as info:
        chat_messages(anthropic([{"role": role, "content": [block]}]))
    assert info.value.status == 400 and info.value.param == "messages.0.content.0.type"


def test_responses_function_calls_join_the_assistant_turn_before_them():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "On it."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = input_messages(validate(ResponsesRequest, {"input": items}))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] == "On it." and messages[2]["content"] == "sunny"


def test_depth_is_bounded_without_recursion():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(OpenAIError, match="deeper than 64"):
        check_depth({"a": deep})
    check_depth({"a": [[[{"b": 1}]]]})
