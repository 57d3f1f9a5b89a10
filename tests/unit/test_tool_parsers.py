"""Tool-call parsers on strings: whole replies, and streams assembled by the openai client."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk as OpenAIChunk

from hybridllm.entrypoints.openai.chat_parsing import ChatParsing, ReplyParser
from hybridllm.entrypoints.openai.protocol import ChatCompletionChunk, ChatStreamChoice
from hybridllm.entrypoints.openai.tool_choice import ToolChoiceConstraint
from hybridllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    get_tool_parser,
)

HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"arguments": {"q": "caf\\u00e9 </tool"}, "name": "search"}\n</tool_call>'
)


def test_hermes_whole_reply():
    reply = HermesToolParser().parse(HERMES_TWO)
    assert reply.content == "Let me check."
    assert [c.name for c in reply.tool_calls] == ["get_weather", "search"]
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris", "days": [1, {"x": "}"}]}
    assert json.loads(reply.tool_calls[1].arguments) == {"q": "café </tool"}
    assert all(c.id.startswith("call_") for c in reply.tool_calls)
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    ],
)
def test_hermes_malformed_stays_text(text):
    reply = HermesToolParser().parse(text)
    assert reply.content == text and reply.tool_calls == ()


def test_hermes_unclosed_block_at_the_end_is_a_call():
    reply = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert reply.content is None and reply.tool_calls[0].name == "f"


def test_llama3_json():
    parser = Llama3JsonToolParser()
    reply = parser.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g"}')
    assert [c.name for c in reply.tool_calls] == ["f", "g"]
    assert json.loads(reply.tool_calls[0].arguments) == {"a": 1}
    assert json.loads(reply.tool_calls[1].arguments) == {}
    assert reply.content is None
    for text in ("Hello {", '{"name": 3}', '{"name": "f"} trailing words', "{"):
        assert parser.parse(text) == type(reply)(text)
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def _openai_accumulate(parser: ReplyParser, text: str, seed: int):
    """Stream `text` in random pieces through our deltas, as SSE JSON into the openai client's
    own ChatCompletionStreamState; returns the message it assembled and the finish reason."""
    rng = random.Random(seed)
    state = ChatCompletionStreamState()
    stream = parser.stream()
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 6)
        piece, pos = text[pos : pos + step], pos + step
        done = pos >= len(text)
        delta = stream.finish(piece) if done else stream.feed(piece)
        reason = ("tool_calls" if stream.num_calls else "stop") if done else None
        chunk = ChatCompletionChunk(
            id="c",
            model="m",
            choices=[ChatStreamChoice(index=0, delta=delta, finish_reason=reason)],
        )
        state.handle_chunk(OpenAIChunk.model_validate_json(chunk.model_dump_json()))
    choice = state.get_final_completion().choices[0]
    return choice.message, choice.finish_reason


DEEP_ARGS = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past Python's recursion limit
HOSTILE = [
    # (text, what the whole-reply parser must make of it: call names, or None for all text)
    ('<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": {"d": Infinity}}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": {"d": [-Infinity]}}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": {"d": 1e999}}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"d\\": NaN}"}</tool_call>', None),
    (f'<tool_call>{{"name": "get_weather", "arguments": {DEEP_ARGS}}}</tool_call>', None),
    ("<tool_call>" + "[" * 100_000, None),  # cut off by max_tokens, deep
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', None),  # cut off
    # A call next to blocks that are not calls: the call is one, the others stay text.
    (
        'A <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> B '
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> C <tool_call>{"name": '
        '"get_weather", "arguments": {"city": NaN}}</tool_call>',
        ["get_weather"],
    ),
]
TOOL_NAMES = ("get_weather", "search")


@pytest.mark.parametrize("text,names", HOSTILE)
def test_hermes_hostile_blocks_stay_text(text, names):
    reply = HermesToolParser(TOOL_NAMES).parse(text)
    if names is None:
        assert reply == type(reply)(text)
        return
    assert [c.name for c in reply.tool_calls] == names
    assert "Oslo" not in reply.content and "nope" in reply.content and "NaN" in reply.content


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "x"}}; {"name": "rm_rf"}',
        '{"name": "get_weather", "parameters": {"x": NaN}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"x": -Infinity}}',
        '{"name": "get_weather", "parameters": {"x": 1e400}}',
        '{"name": "get_weather", "parameters": ' + DEEP_ARGS + "}",
        "{" * 100_000,
    ],
)
def test_llama3_json_hostile_replies_stay_text(text):
    parser = Llama3JsonToolParser(TOOL_NAMES)
    assert parser.parse(text) == type(parser.parse(text))(text)
    stream = parser.stream()
    out = stream.feed(text)
    out.extend(stream.finish())
    assert out.content == text and not out.tool_calls and stream.num_calls == 0


def test_tool_names_none_accepts_any_name_but_not_bad_arguments():
    assert HermesToolParser().parse(HOSTILE[0][0]).tool_calls[0].name == "rm_rf"
    assert not HermesToolParser().parse(HOSTILE[1][0]).tool_calls
    assert get_tool_parser("llama3_json").parse('{"name": "zz"}').tool_calls[0].name == "zz"


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "parser_name,text",
    [
        ("hermes", HERMES_TWO),
        ("hermes", "Plain answer with a < sign and <tool no call."),
        ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2], "b": "x"}}'),
        ("llama3_json", "Just text {with braces}"),
        *(("hermes", text) for text, _ in HOSTILE if len(text) < 1000),
        ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"a": {"[" * 200}1{"]" * 200}}}}}'),
    ],
)
def test_streamed_calls_assemble_like_whole_replies(parser_name, text, seed):
    # The request offered these functions; HERMES_TWO and the llama3 replies call them.
    names = ["get_weather", "search", "f"]
    parser = ReplyParser(ChatParsing(tool_call_parser=parser_name), "auto", tool_names=names)
    whole = parser.parse(text)
    message, reason = _openai_accumulate(parser, text, seed)
    assert (message.content or "").strip() == (whole.content or "").strip()
    calls = message.tool_calls or []
    assert [c.function.name for c in calls] == [c.function.name for c in whole.tool_calls]
    for got, want in zip(calls, whole.tool_calls):
        assert got.id.startswith("call_") and got.type == "function"
        assert json.loads(got.function.arguments) == json.loads(want.function.arguments)
    assert reason == ("tool_calls" if whole.tool_calls else "stop")


@pytest.mark.parametrize("text", [text for text, _ in HOSTILE if len(text) > 1000])
def test_hermes_streams_deep_blocks_as_text(text):
    stream = HermesToolParser(TOOL_NAMES).stream()
    out = stream.feed(text[:500])
    for i in range(500, len(text), 50_000):
        out.extend(stream.feed(text[i : i + 50_000]))
    out.extend(stream.finish())
    assert out.content == text and not out.tool_calls and stream.num_calls == 0


def test_hermes_holds_a_block_until_it_is_known_to_be_a_call():
    stream = ReplyParser(ChatParsing(tool_call_parser="hermes"), "auto", tool_names=["f"]).stream()
    first = stream.feed('Sure. <tool_call>{"name": "f", "arguments": {"city": "Par')
    assert first.content == "Sure. " and first.tool_calls is None
    # Arguments could still turn out not to be JSON (NaN, cut off): nothing goes out yet.
    assert stream.feed('is"}}').tool_calls is None
    (head, args) = stream.feed("</tool_call>").tool_calls
    assert head.function.name == "f" and head.id and head.index == args.index == 0
    assert json.loads(args.function.arguments) == {"city": "Paris"}
    assert stream.finish("").tool_calls is None and stream.num_calls == 1
    unknown = ReplyParser(ChatParsing(tool_call_parser="hermes"), "auto", tool_names=["f"])
    block = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    stream = unknown.stream()
    assert stream.feed(block).content == block and stream.num_calls == 0


def test_tool_choice_none_and_no_parser_pass_text_through():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert ReplyParser(ChatParsing("hermes"), "none").parse(text).content == text
    assert not ReplyParser(ChatParsing(), "auto").active


def test_constraint_schemas_and_parsing():
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    named = ToolChoiceConstraint.build([("get_weather", weather)], named=True)
    assert named.reply_schema() == weather
    assert named.parse('{"city": "Oslo"}')[0].name == "get_weather"
    assert named.parse("[1]") == () and named.parse("{") == ()
    required = ToolChoiceConstraint.build([("a", None), ("b", weather)], named=False)
    schema = required.reply_schema()
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    calls = required.parse(
        '[{"name": "b", "parameters": {"city": "x"}}, {"name": "a", "parameters": {}}]'
    )
    assert [c.name for c in calls] == ["b", "a"]
    assert required.parse('[{"name": "zzz", "parameters": {}}]') == ()
    parser = ReplyParser(ChatParsing(), "named", named)
    message, reason = _openai_accumulate(parser, '{"city": "Oslo"}', seed=1)
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert reason == "tool_calls"
