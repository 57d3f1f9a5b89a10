"""Tool calls out of a model's own text: hermes (<tool_call> blocks) and Llama 3 JSON, whole or streamed."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from hybridllm.json_limits import (
    MAX_JSON_DEPTH,
    STRICT_DECODER,
    loads_strict,
    text_depth,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's `function.arguments` carries)
    id: str = field(default_factory=tool_call_id)


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text around the calls; None when there is none
    tool_calls: tuple[ParsedToolCall, ...] = ()


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: id and name in its first piece, then arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def _as_call(
    obj: Any, arguments_key: str, tool_names: Collection[str] | None
) -> ParsedToolCall | None:
    """A {"name": <one of tool_names>, <arguments_key>: object} dict as a call; anything else
    (another function, arguments that are not a strict JSON object) is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None  # the model made up a function: the request did not offer it
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models double-encode; accept only a JSON object inside
        try:
            args = loads_strict(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a non-finite float; the strict decoders refuse those already
        return None
    return ParsedToolCall(obj["name"], arguments)


def _loads_call(
    text: str, arguments_key: str, tool_names: Collection[str] | None
) -> ParsedToolCall | None:
    """One call out of model text, or None: not JSON, not strict JSON, nested too deep
    (JSONTooDeep is a ValueError, checked before parsing), or not a call to an offered tool."""
    try:
        return _as_call(loads_strict(text), arguments_key, tool_names)
    except ValueError:
        return None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _tidy(text: str) -> str | None:
    return text.strip() or None


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes).

    Each block is a call only if it names a function in `tool_names` (None: any name) with
    arguments that are a strict JSON object (no NaN or Infinity, at most MAX_JSON_DEPTH deep);
    any other block stays in the content as the model wrote it, and the other blocks are still
    calls: the rule a stream can keep too, since it cannot take back a call already sent.
    """

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def block_call(self, body: str) -> ParsedToolCall | None:
        """The call in one block's text (between the tags), or None if it is not one."""
        return _loads_call(body, "arguments", self.tool_names)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ParsedToolCall] = []
        kept: list[str] = []  # the text outside the blocks that are calls
        pos = 0
        for match in self._BLOCK.finditer(text):
            call = self.block_call(match.group(1))
            if call is None:  # not a call: the block stays text, nothing is guessed
                continue
            kept.append(text[pos : match.start()])
            pos = match.end()
            calls.append(call)
        if not calls:
            return ParsedReply(text)
        kept.append(text[pos:])
        return ParsedReply(_tidy("".join(kept)), tuple(calls))

    def stream(self) -> HermesToolStream:
        return HermesToolStream(self)


class HermesToolStream:
    """Incremental hermes parsing: text outside blocks streams as content as it comes (held
    back only while it could be the start of a tag); a block is held until its end tag (or the
    end of the reply), then goes out as one call, checked like a whole reply's, or as content.

    Holding the block is what keeps a stream and a whole reply the same: whether a block is a
    call (an offered function, arguments a strict JSON object) is only known at its end, and a
    call's name or arguments, once sent, cannot be taken back.
    """

    def __init__(self, parser: HermesToolParser) -> None:
        self._parser = parser
        self._buffer = ""  # text not yet classified (a possible tag start, or an open block)
        self._in_block = False
        self._searched = 0  # how much of an open block's buffer has no end tag in it
        self._index = -1

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        out = StreamDelta()
        while True:
            if not self._in_block:
                start = self._buffer.find(HermesToolParser.START)
                if start < 0:
                    keep = _held_prefix(self._buffer, HermesToolParser.START)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(HermesToolParser.START) :]
                self._in_block, self._searched = True, 0
            # Search only the new text (and a tag's length before it): a long block is not
            # searched again from its start on every token.
            end = self._buffer.find(HermesToolParser.END, self._searched)
            if end < 0:
                self._searched = max(len(self._buffer) - len(HermesToolParser.END) + 1, 0)
                return out
            out.extend(self._close_block(self._buffer[:end], HermesToolParser.END))
            self._buffer = self._buffer[end + len(HermesToolParser.END) :]
            self._in_block = False

    def finish(self) -> StreamDelta:
        """The end of the reply: an unclosed block is checked as if its end tag came (as the
        whole-reply parser reads it)."""
        if self._in_block:
            out = self._close_block(self._buffer, "")
        else:
            out = StreamDelta(content=self._buffer)
        self._buffer, self._in_block = "", False
        return out

    @property
    def num_calls(self) -> int:
        return self._index + 1

    def _close_block(self, body: str, end_tag: str) -> StreamDelta:
        call = self._parser.block_call(body)
        if call is None:  # the block as the model wrote it, tags included
            return StreamDelta(content=HermesToolParser.START + body + end_tag)
        self._index += 1
        return StreamDelta(
            tool_calls=[
                ToolCallDelta(self._index, call.id, call.name),
                ToolCallDelta(self._index, arguments=call.arguments),
            ]
        )


class Llama3JsonToolParser:
    """Llama 3.1+'s JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. A reply is calls only if it starts as one and
    every part is a call to a function in `tool_names` (None: any name) with strict JSON
    arguments at most MAX_JSON_DEPTH deep; otherwise it is all text."""

    TAG = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{") or text_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return ParsedReply(text)
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, pos = STRICT_DECODER.raw_decode(body, pos)
            except ValueError:
                return ParsedReply(text)
            call = _as_call(obj, "parameters", self.tool_names)
            if call is None:
                return ParsedReply(text)
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedReply(None, tuple(calls))

    def stream(self) -> Llama3JsonToolStream:
        return Llama3JsonToolStream(self)


class Llama3JsonToolStream:
    """A reply that starts like a call is held until the end and parsed whole (a Llama 3 call is
    the entire reply); any other reply streams as content from its first characters."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self._parser = parser
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content" or "call"
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        if self._mode == "content":
            return StreamDelta(content=text)
        self._buffer += text
        head = self._buffer.lstrip()
        if not head:
            return StreamDelta()
        tag = Llama3JsonToolParser.TAG
        if head.startswith("{") or head.startswith(tag):
            self._mode = "call"
            return StreamDelta()
        if tag.startswith(head):
            return StreamDelta()  # maybe the start of the tag
        self._mode, text, self._buffer = "content", self._buffer, ""
        return StreamDelta(content=text)

    def finish(self) -> StreamDelta:
        text, self._buffer = self._buffer, ""
        if self._mode != "call":
            return StreamDelta(content=text)
        reply = self._parser.parse(text)
        if not reply.tool_calls:
            return StreamDelta(content=text)
        out = StreamDelta()
        for index, call in enumerate(reply.tool_calls):
            out.tool_calls.append(ToolCallDelta(index, call.id, call.name))
            out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments))
        self.num_calls = len(reply.tool_calls)
        return out


def get_tool_parser(
    name: str, tool_names: Collection[str] | None = None
) -> HermesToolParser | Llama3JsonToolParser:
    """The parser `name`; calls to functions outside `tool_names` (the request's tools; None:
    any name) stay text."""
    if name == "hermes":
        return HermesToolParser(tool_names)
    if name == "llama3_json":
        return Llama3JsonToolParser(tool_names)
    raise ValueError(
        f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}"
    )
