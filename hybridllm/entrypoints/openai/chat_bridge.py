"""Other APIs (Anthropic Messages, OpenAI Responses) run as chat completions: body, request, reply."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.entrypoints.openai.protocol import ChatCompletionRequest
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat
from hybridllm.json_limits import value_depth

# Deeper than any real tool schema; shallow enough that nothing downstream (json.dumps, the chat
# template, the grammar compiler) can run out of recursion on a hostile body.
MAX_JSON_DEPTH = 64

M = TypeVar("M", bound=BaseModel)


async def read_json_object(raw: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 (malformed, not an object, nested too deeply)."""
    data = await raw.body()
    try:
        body = json.loads(data)
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply") from None
    except ValueError as exc:  # also bad UTF-8 and integers past Python's digit limit
        raise OpenAIError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    check_depth(body)
    return body


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    if value_depth(value, limit) > limit:
        raise OpenAIError(f"the request body nests deeper than {limit} levels")


def validate(model: type[M], body: dict[str, Any]) -> M:
    """`model.model_validate(body)`, a validation failure as a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors()
    # The deepest error: of a union's members, the one the body got furthest into (a block
    # with an unknown type says so, not that the content is not a string).
    first = max(errors, key=lambda error: len(error["loc"]))
    # Union members show up in the location as their type names ("str", "list[...]"): noise.
    loc = [str(p) for p in first["loc"]]
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
    param = ".".join(loc) or None
    if first["type"] == "missing":
        message = f"missing required field '{param}'"
    else:
        message = f"invalid value for '{param}': {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return OpenAIError(message, param=param)


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A translated body as the chat endpoint's request (its own checks as 400s)."""
    return validate(ChatCompletionRequest, body)


async def complete(chat: OpenAIServingChat, request: ChatCompletionRequest, raw: Request) -> dict:
    """A non-streamed chat completion's body: everything the chat endpoint checks and does."""
    response = await chat.create_chat_completion(request, raw)
    return json.loads(response.body)


async def stream(
    chat: OpenAIServingChat,
    request: ChatCompletionRequest,
    raw: Request,
    translate: Callable[[AsyncIterator[Piece]], AsyncIterator[str]],
) -> Response:
    """The chat endpoint's SSE response with its body translated: the response keeps aborting
    the engine request however the stream ends."""
    response = await chat.create_chat_completion(request, raw)
    response.body_iterator = translate(reply_pieces(response.body_iterator))
    return response


@dataclass
class Piece:
    """One step of a streamed reply. `kind`: "reasoning" / "text" (`text`), "call" (a new call
    `index` with `call_id` and `name`), "arguments" (`text` of call `index`), "end"
    (`finish_reason`, `stop_reason`) or "error" (`error`, OpenAI's error object).
    `usage` is the latest usage the chat stream reported (prompt_tokens, completion_tokens)."""

    kind: str
    usage: dict[str, Any] | None
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    error: dict[str, Any] | None = None


async def reply_pieces(body: AsyncIterator[str | bytes]) -> AsyncIterator[Piece]:
    """Chat chunks (the request asked for continuous usage) -> pieces. Whitespace before a text
    part is held until real text follows, so the blank lines around tool calls open no text
    block; a reply of only whitespace comes out at its end."""
    usage: dict[str, Any] | None = None
    held, last, emitted = "", "", False
    end: Piece | None = None
    async with aclosing(body):
        async for event in body:
            data = event.decode() if isinstance(event, bytes) else event
            payload = data.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                yield Piece("error", usage, error=chunk["error"])
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    last, emitted = "reasoning", True
                    yield Piece("reasoning", usage, text=delta["reasoning_content"])
                text = delta.get("content") or ""
                if text and last != "text" and not text.strip():
                    held += text
                elif text:
                    text, held, last, emitted = held + text, "", "text", True
                    yield Piece("text", usage, text=text)
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    if call.get("id"):
                        held, last, emitted = "", "call", True
                        yield Piece(
                            "call",
                            usage,
                            index=call["index"],
                            call_id=call["id"],
                            name=function.get("name") or "",
                        )
                    if function.get("arguments"):
                        yield Piece(
                            "arguments", usage, text=function["arguments"], index=call["index"]
                        )
                if choice.get("finish_reason") is not None:
                    end = Piece(
                        "end",
                        usage,
                        finish_reason=choice["finish_reason"],
                        stop_reason=choice.get("stop_reason"),
                    )
    if held and not emitted:
        yield Piece("text", usage, text=held)
    if end is not None:
        end.usage = usage  # the last chunk carries the final usage
        yield end
