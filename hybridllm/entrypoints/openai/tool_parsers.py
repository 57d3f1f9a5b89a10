"""Tool calls out of a model's own text: hermes (<tool_call> blocks) and Llama 3 JSON, whole or streamed."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

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


def _as_call(obj: Any, arguments_key: str) -> ParsedToolCall | None:
    """A {"name": str, <arguments_key>: object} dict as a call; anything else is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models double-encode; accept only a JSON object inside
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _tidy(text: str) -> str | None:
    return text.strip() or None


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes)."""

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ParsedToolCall] = []
        for match in self._BLOCK.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:  # a malformed block: the reply stays text, nothing is guessed
                return ParsedReply(text)
            calls.append(call)
        if not calls:
            return ParsedReply(text)
        return ParsedReply(_tidy(self._BLOCK.sub("", text)), tuple(calls))

    def stream(self) -> HermesToolStream:
        return HermesToolStream()


# The head of a block in the order templates ask for: name first, then the arguments object.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolStream:
    """Incremental hermes parsing: text outside blocks is content; inside, the name goes out as
    soon as it is complete and the arguments as they grow (held back: the object's closing
    brace and whatever could still be the end tag)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet classified (a possible tag start, or an open block)
        self._in_block = False
        self._index = -1
        self._head_end: int | None = None  # where the arguments start in the open block
        self._sent_args = 0

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
                self._in_block, self._head_end, self._sent_args = True, None, 0
                self._index += 1
            end = self._buffer.find(HermesToolParser.END)
            body = self._buffer if end < 0 else self._buffer[:end]
            out.tool_calls.extend(self._block_progress(body, closed=end >= 0))
            if end < 0:
                return out
            self._buffer = self._buffer[end + len(HermesToolParser.END) :]
            self._in_block = False

    def finish(self) -> StreamDelta:
        """The end of the reply: an unclosed block is completed as if its end tag came."""
        out = StreamDelta()
        if self._in_block:
            out.tool_calls.extend(self._block_progress(self._buffer, closed=True))
        else:
            out.content = self._buffer
        self._buffer, self._in_block = "", False
        return out

    @property
    def num_calls(self) -> int:
        return self._index + 1

    def _block_progress(self, body: str, closed: bool) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self._head_end is None:
            head = _HERMES_HEAD.match(body)
            if head is None:
                if not closed:
                    return deltas
                # Another key order, or no arguments key: parse the whole block at its end.
                try:
                    call = _as_call(json.loads(body), "arguments")
                except ValueError:
                    call = None
                if call is not None:
                    deltas.append(ToolCallDelta(self._index, tool_call_id(), call.name))
                    deltas.append(ToolCallDelta(self._index, arguments=call.arguments))
                return deltas
            self._head_end = head.end()
            name = json.loads(f'"{head.group(1)}"')
            deltas.append(ToolCallDelta(self._index, tool_call_id(), name))
        args = body[self._head_end :]
        if closed:
            args = args.rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args  # the block's own brace
        else:
            args = args[: len(args) - _held_prefix(args, HermesToolParser.END)].rstrip()
            if args.endswith("}"):  # maybe the block's own closing brace: not yet known
                args = args[:-1]
        if len(args) > self._sent_args:
            deltas.append(ToolCallDelta(self._index, arguments=args[self._sent_args :]))
            self._sent_args = len(args)
        return deltas


class Llama3JsonToolParser:
    """Llama 3.1+'s JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. A reply is a call only if it starts as one."""

    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedReply(text)
        calls: list[ParsedToolCall] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedReply(text)
            call = _as_call(obj, "parameters")
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


def get_tool_parser(name: str) -> HermesToolParser | Llama3JsonToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(
        f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}"
    )
