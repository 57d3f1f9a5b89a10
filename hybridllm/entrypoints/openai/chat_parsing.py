"""A chat reply's text -> reasoning, content and tool calls: the server's parsers per request."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from hybridllm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from hybridllm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from hybridllm.entrypoints.openai.tool_choice import ToolChoiceConstraint
from hybridllm.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    StreamDelta,
    get_tool_parser,
)


@dataclass(frozen=True)
class ChatParsing:
    """The server's --tool-call-parser and --reasoning-parser (None: not parsed)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            get_tool_parser(self.tool_call_parser)  # raises, naming the choices
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            get_reasoning_parser(self.reasoning_parser)


@dataclass(frozen=True)
class ParsedMessage:
    reasoning_content: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class ReplyParser:
    """One request's parsing: reasoning first (the think block comes before any call), then
    tool calls out of what is left, by the model's format (`auto`) or by the schema the reply
    was constrained to (`required` / named).

    `tool_names`: the functions the request offered; a parsed call to any other stays text.
    None accepts any name: pass the names whenever the request has tools.
    """

    def __init__(
        self,
        parsing: ChatParsing,
        tool_choice: str,
        constraint: ToolChoiceConstraint | None = None,
        tool_names: Collection[str] | None = None,
    ) -> None:
        self._reasoning: ReasoningParser | None = (
            get_reasoning_parser(parsing.reasoning_parser) if parsing.reasoning_parser else None
        )
        self._constraint = constraint
        self._tool_parser = (
            get_tool_parser(parsing.tool_call_parser, tool_names)
            if tool_choice == "auto" and parsing.tool_call_parser and constraint is None
            else None
        )

    @property
    def active(self) -> bool:
        return (
            self._reasoning is not None
            or self._tool_parser is not None
            or self._constraint is not None
        )

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = (
            (None, text) if self._reasoning is None else self._reasoning.parse(text)
        )
        calls = ()
        if content is not None and self._constraint is not None:
            calls = self._constraint.parse(content)
            content = None if calls else content
        elif content is not None and self._tool_parser is not None:
            reply = self._tool_parser.parse(content)
            content, calls = reply.content, reply.tool_calls
        tool_calls = tuple(
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        )
        return ParsedMessage(reasoning, content, tool_calls)

    def stream(self) -> ReplyStream:
        tools = self._constraint or self._tool_parser
        return ReplyStream(
            None if self._reasoning is None else self._reasoning.stream(),
            None if tools is None else tools.stream(),
        )


class ReplyStream:
    """One sample's streamed deltas through the same parsers; `num_calls` so far."""

    def __init__(self, reasoning: ReasoningStream | None, tools: object | None) -> None:
        self._reasoning = reasoning
        self._tools = tools  # a HermesToolStream, Llama3JsonToolStream or ConstrainedToolStream

    @property
    def num_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def feed(self, text: str) -> DeltaMessage:
        return self._step(text, final=False)

    def finish(self, text: str) -> DeltaMessage:
        """The last piece of text, then everything held back."""
        return self._step(text, final=True)

    def _step(self, text: str, final: bool) -> DeltaMessage:
        reasoning, content = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        if final and self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        out = StreamDelta(content=content)
        if self._tools is not None:
            out = self._tools.feed(content)
            if final:
                out.extend(self._tools.finish())
        calls = [
            DeltaToolCall(
                index=piece.index,
                id=piece.id,
                type="function" if piece.id is not None else None,
                function=DeltaFunctionCall(
                    name=piece.name,
                    arguments=piece.arguments if piece.arguments or piece.id else None,
                ),
            )
            for piece in out.tool_calls
        ]
        return DeltaMessage(
            content=out.content if out.content or not (reasoning or calls) else None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
