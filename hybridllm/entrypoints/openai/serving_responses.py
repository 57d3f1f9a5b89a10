"""POST /v1/responses: OpenAI's Responses API on the chat path, with previous_response_id."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.entrypoints.openai import chat_bridge
from hybridllm.entrypoints.openai.chat_bridge import Piece
from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    assistant_turn,
    chat_body,
    function_call_item,
    input_messages,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_object,
)
from hybridllm.entrypoints.openai.responses_store import ResponseStore
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat

# Chat parameter names as the Responses API calls them, for the errors the chat path raises.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


class OpenAIServingResponses:
    """Each request runs as a chat completion (the chat endpoint's limits, template, tool
    parsing and constrained tool choice); the conversation of a stored response is kept in
    `store` for a later request's previous_response_id."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create_response(self, raw: Request) -> Response:
        try:
            return await self._create(raw)
        except OpenAIError as exc:
            head = (exc.param or "").split(".", 1)[0]
            if head in _PARAMS:  # the chat message indices are not the input's: name the field
                exc.param = _PARAMS[head]
            raise

    async def _create(self, raw: Request) -> Response:
        request = chat_bridge.validate(ResponsesRequest, await chat_bridge.read_json_object(raw))
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            found = self.store.get(request.previous_response_id)
            if found is None:
                raise OpenAIError(
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = found
        conversation = history + input_messages(request)
        if not conversation:
            raise OpenAIError("input must not be empty", param="input")
        chat_request = chat_bridge.chat_request(chat_body(request, conversation))
        model = self.chat.check_model(request.model)
        response_id = new_id("resp")

        def finish(output: list[dict[str, Any]]) -> None:
            if request.store:
                self.store.put(response_id, [*conversation, assistant_turn(output)])

        build = partial(response_object, request, response_id, model, int(time.time()))
        if request.stream:
            events = partial(response_events, build=build, finish=finish)
            return await chat_bridge.stream(self.chat, chat_request, raw, events)
        reply = await chat_bridge.complete(self.chat, chat_request, raw)
        choice = reply["choices"][0]
        output = output_items(choice["message"], choice["finish_reason"])
        finish(output)
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return JSONResponse(build(status, output, reply.get("usage")))


async def response_events(
    pieces: AsyncIterator[Piece],
    build: Callable[..., dict[str, Any]],
    finish: Callable[[list[dict[str, Any]]], None],
) -> AsyncIterator[str]:
    """A streamed chat reply as Responses events: created and in_progress, then per output item
    (reasoning, message, function call) its added / delta / done events, then completed
    (incomplete when cut off by max_output_tokens, failed on an error)."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        payload = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    output: list[dict[str, Any]] = []  # every item so far, the open one last
    is_open = False
    calls: dict[int, int] = {}  # chat tool-call index -> its item's output index

    def close(status: str = "completed") -> list[str]:
        item, index = output[-1], len(output) - 1
        item["status"] = status
        ref = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "function_call":
            args = item["arguments"]
            out.append(event("response.function_call_arguments.done", **ref, arguments=args))
        else:
            text = item.pop("text")
            message = item["type"] == "message"
            done = message_item if message else reasoning_item
            item.update(done(item["id"], text, status))
            part = item["content"][0]
            kind = "response.output_text.done" if message else "response.reasoning_text.done"
            extra = {"logprobs": []} if message else {}
            out.append(event(kind, **ref, content_index=0, text=text, **extra))
            out.append(event("response.content_part.done", **ref, content_index=0, part=part))
        out.append(event("response.output_item.done", output_index=index, item=item))
        return out

    yield event("response.created", response=build("in_progress", []))
    yield event("response.in_progress", response=build("in_progress", []))
    async for piece in pieces:
        if piece.kind == "error":
            error = piece.error or {}
            code, message = error.get("code") or "server_error", error.get("message") or ""
            yield event("error", code=code, message=message, param=error.get("param"))
            failed = build("failed", output, piece.usage, {"code": code, "message": message})
            yield event("response.failed", response=failed)
            return
        if piece.kind == "end":
            status = "incomplete" if piece.finish_reason == "length" else "completed"
            for text in close(status) if is_open else []:
                yield text
            finish(output)
            yield event(f"response.{status}", response=build(status, output, piece.usage))
            return
        if piece.kind == "arguments":
            index = calls.get(piece.index)
            if index is not None:
                item = output[index]
                item["arguments"] += piece.text
                ref = {"item_id": item["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **ref, delta=piece.text)
            continue
        kind = {"reasoning": "reasoning", "text": "message", "call": "function_call"}[piece.kind]
        if not is_open or output[-1]["type"] != kind or kind == "function_call":
            for text in close() if is_open else []:
                yield text
            is_open, index = True, len(output)
            if kind == "function_call":
                item = function_call_item(
                    new_id("fc"), piece.call_id, piece.name, "", "in_progress"
                )
                calls[piece.index] = index
            elif kind == "message":
                item = message_item(new_id("msg"), "", "in_progress")
            else:
                item = reasoning_item(new_id("rs"), "", "in_progress")
            output.append(item)
            yield event("response.output_item.added", output_index=index, item=item)
            if kind != "function_call":
                item["text"] = ""  # what the deltas have said, until the item is done
                part_type = "output_text" if kind == "message" else "reasoning_text"
                part = {"type": part_type, "text": ""}
                if kind == "message":
                    part.update(annotations=[], logprobs=[])
                ref = {"item_id": item["id"], "output_index": index, "content_index": 0}
                yield event("response.content_part.added", **ref, part=part)
        if kind != "function_call":
            item = output[-1]
            item["text"] += piece.text
            ref = {"item_id": item["id"], "output_index": len(output) - 1, "content_index": 0}
            if kind == "message":
                yield event("response.output_text.delta", **ref, delta=piece.text, logprobs=[])
            else:
                yield event("response.reasoning_text.delta", **ref, delta=piece.text)
