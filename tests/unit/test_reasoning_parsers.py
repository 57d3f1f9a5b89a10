"""Reasoning parsers on strings: whole replies and streams cut at every possible point."""

from __future__ import annotations

import pytest

from hybridllm.entrypoints.openai.chat_parsing import ChatParsing, ReplyParser
from hybridllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("qwen3", "<think>\nSum it.\n</think>\n\nIt is 4.", ("\nSum it.\n", "It is 4.")),
        ("qwen3", "It is 4.", (None, "It is 4.")),  # thinking off: no block, all content
        ("qwen3", "<think>cut off while thi", ("cut off while thi", None)),
        ("deepseek_r1", "Sum it.</think>It is 4.", ("Sum it.", "It is 4.")),
        ("deepseek_r1", "<think>Sum it.</think>It is 4.", ("Sum it.", "It is 4.")),
        ("deepseek_r1", "still thinking", ("still thinking", None)),
        ("qwen3", "<think></think>Direct.", (None, "Direct.")),
    ],
)
def test_whole_reply(name, text, expected):
    assert get_reasoning_parser(name).parse(text) == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(
    "text",
    [
        "<think>\nSum it.\n</think>\n\nIt is 4.",
        "It is <4> and </thin",
        "<think>a</think>",
        "<thi",
        "  <think>x</think>y",
    ],
)
def test_stream_matches_whole_at_every_cut(name, text):
    parser = get_reasoning_parser(name)
    want_reasoning, want_content = parser.parse(text)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            stream = parser.stream()
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            reasoning = content = ""
            for piece in pieces:
                r, c = stream.feed(piece)
                reasoning, content = reasoning + r, content + c
            r, c = stream.finish()
            reasoning, content = reasoning + r, content + c
            assert "<think>" not in reasoning + content or "<think>" in (want_content or "")
            assert (reasoning or None, content or None) == (
                want_reasoning,
                want_content if want_content is None else want_content,
            ), (cut, step)


def test_reasoning_then_tool_call():
    parser = ReplyParser(ChatParsing("hermes", "qwen3"), "auto")
    text = '<think>Need weather.</think>\n<tool_call>{"name": "w", "arguments": {}}</tool_call>'
    parsed = parser.parse(text)
    assert parsed.reasoning_content == "Need weather."
    assert parsed.content is None and parsed.tool_calls[0].function.name == "w"
    stream = parser.stream()
    deltas = [stream.feed(text[i : i + 4]) for i in range(0, len(text) - 4, 4)]
    deltas.append(stream.finish(text[len(deltas) * 4 :]))
    assert "".join(d.reasoning_content or "" for d in deltas) == "Need weather."
    assert not "".join(d.content or "" for d in deltas).strip()
    assert stream.num_calls == 1


def test_unknown_parser():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatParsing(reasoning_parser="o1")
