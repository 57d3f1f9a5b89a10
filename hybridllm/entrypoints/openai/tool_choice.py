"""tool_choice "required" / a named function: the JSON schema a reply must follow, and its calls.

Prompting cannot make a model call a tool, so these choices are enforced by constraining
generation to `ToolChoiceConstraint.reply_schema()` with the structured-output engine. That
engine plugs in as a `ToolChoiceEnforcer`: given the constraint and the request's sampling
parameters, it returns parameters that constrain the reply to the schema (or raises
OpenAIError for a schema it cannot compile). Without one, these choices are a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridllm.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    StreamDelta,
    ToolCallDelta,
    tool_call_id,
)
from hybridllm.json_limits import loads_strict
from hybridllm.sampling_params import SamplingParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoiceConstraint:
    """`functions` are (name, parameters schema) pairs; `named`: exactly that one function."""

    functions: tuple[tuple[str, str], ...]  # parameters kept as JSON text: hashable, frozen
    named: bool

    @classmethod
    def build(
        cls, functions: list[tuple[str, dict[str, Any] | None]], named: bool
    ) -> ToolChoiceConstraint:
        return cls(
            tuple(
                (name, json.dumps(params or ANY_OBJECT, sort_keys=True))
                for name, params in functions
            ),
            named,
        )

    def reply_schema(self) -> dict[str, Any]:
        """Named: the reply is the arguments object itself. Required: a non-empty JSON array of
        {"name": ..., "parameters": {...}} objects, one schema branch per function."""
        if self.named:
            return json.loads(self.functions[0][1])
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": json.loads(params)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in self.functions
        ]
        items = branches[0] if len(branches) == 1 else {"anyOf": branches}
        return {"type": "array", "minItems": 1, "items": items}

    def parse(self, text: str) -> tuple[ParsedToolCall, ...]:
        """The calls in a constrained reply; () if it does not follow the schema (cut off by
        max_tokens, say), and the caller then returns the text as content."""
        try:  # model output: depth-bounded and strict, like every parser's (json_limits)
            value = loads_strict(text)
        except ValueError:
            return ()
        if self.named:
            if not isinstance(value, dict):
                return ()
            return (ParsedToolCall(self.functions[0][0], json.dumps(value, ensure_ascii=False)),)
        names = {name for name, _ in self.functions}
        if not isinstance(value, list) or not value:
            return ()
        calls = []
        for item in value:
            if not (isinstance(item, dict) and item.get("name") in names):
                return ()
            params = item.get("parameters", {})
            if not isinstance(params, dict):
                return ()
            calls.append(ParsedToolCall(item["name"], json.dumps(params, ensure_ascii=False)))
        return tuple(calls)

    def stream(self) -> ConstrainedToolStream:
        return ConstrainedToolStream(self)


class ConstrainedToolStream:
    """Named: the reply is the arguments, streamed as they come after a first delta with the
    name. Required: the array is parsed at the end (its item boundaries are not worth tracking)."""

    def __init__(self, constraint: ToolChoiceConstraint) -> None:
        self._constraint = constraint
        self._buffer = ""
        self._started = False
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        if not self._constraint.named:
            self._buffer += text
            return StreamDelta()
        out = StreamDelta()
        if not self._started:
            self._started, self.num_calls = True, 1
            out.tool_calls.append(
                ToolCallDelta(0, tool_call_id(), self._constraint.functions[0][0])
            )
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> StreamDelta:
        if self._constraint.named:
            return self.feed("") if not self._started else StreamDelta()
        calls = self._constraint.parse(self._buffer)
        if not calls:
            return StreamDelta(content=self._buffer)
        out = StreamDelta()
        for index, call in enumerate(calls):
            out.tool_calls.append(ToolCallDelta(index, call.id, call.name))
            out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments))
        self.num_calls = len(calls)
        return out


# The structured-output engine's hook (see the module docstring).
ToolChoiceEnforcer = Callable[[ToolChoiceConstraint, SamplingParams], SamplingParams]
