"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.engine.errors import EngineDeadError
from hybridllm.entrypoints.openai import chat_bridge
from hybridllm.entrypoints.openai.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    error_response,
    message_from_chat,
    stop_reason,
    usage,
)
from hybridllm.entrypoints.openai.chat_bridge import Piece
from hybridllm.entrypoints.openai.errors import (
    ClientDisconnected,
    OpenAIError,
    engine_dead_message,
    internal_error_message,
    request_id_of,
)
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat

logger = logging.getLogger(__name__)


class AnthropicServingMessages:
    """Each request is translated into a chat completion, run by the chat endpoint (its limits,
    template, tool parsing and constrained tool choice), and its reply translated back."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, raw: Request) -> Response:
        return await self._answer(raw, self._create)

    async def count_tokens(self, raw: Request) -> Response:
        return await self._answer(raw, self._count)

    async def _answer(
        self, raw: Request, handler: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Every failure in Anthropic's error shape (its client reads `error.message`)."""
        try:
            return await handler(raw)
        except OpenAIError as exc:
            return error_response(exc.message, exc.status)
        except EngineDeadError as exc:
            return error_response(engine_dead_message(str(exc)), 503)
        except ClientDisconnected:
            raise
        except Exception:
            request_id = request_id_of(raw)
            logger.exception("unhandled error on %s (request id %s)", raw.url.path, request_id)
            return error_response(internal_error_message(request_id), 500)

    async def _create(self, raw: Request) -> Response:
        request = chat_bridge.validate(MessagesRequest, await chat_bridge.read_json_object(raw))
        chat_request = chat_bridge.chat_request(chat_body(request))
        if request.stream:
            events = partial(anthropic_events, model=self.chat.model.names[0])
            return await chat_bridge.stream(self.chat, chat_request, raw, events)
        reply = await chat_bridge.complete(self.chat, chat_request, raw)
        return JSONResponse(message_from_chat(reply))

    async def _count(self, raw: Request) -> Response:
        """The prompt's tokens as /v1/messages would run it (template, tools and all)."""
        request = chat_bridge.validate(CountTokensRequest, await chat_bridge.read_json_object(raw))
        chat_request = chat_bridge.chat_request(chat_body(request))
        self.chat.check_model(chat_request.model)
        limit = self.chat.limits.max_chat_messages
        if len(chat_request.messages) > limit:
            raise OpenAIError(f"at most {limit} messages per request", param="messages")
        chat_request.tool_choice_mode()  # the tools' own checks (unique names, object schemas)
        prompt_ids = await self.chat.render_prompt(chat_request)
        return JSONResponse({"input_tokens": len(prompt_ids)})


def _event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


def _error_type(chat_error: dict[str, Any]) -> str:
    invalid = chat_error.get("type") == "invalid_request_error"
    return "invalid_request_error" if invalid else "api_error"


_BLOCK_KINDS = {"reasoning": "thinking", "text": "text", "call": "tool_use"}
_DELTA_TYPES = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


async def anthropic_events(pieces: AsyncIterator[Piece], model: str) -> AsyncIterator[str]:
    """A streamed chat reply as Anthropic's events: message_start (once the prompt's token count
    is known), ping, one content block per thinking / text / tool call run, message_delta with
    the stop reason and usage, message_stop."""
    started = False
    index = -1  # the open block; -1: none yet
    open_kind: str | None = None
    call_blocks: dict[int, int] = {}  # chat tool-call index -> block index
    async for piece in pieces:
        if piece.kind == "error":
            error = piece.error or {}
            text = error.get("message") or "the stream failed"
            yield _event({"type": "error", "error": {"type": _error_type(error), "message": text}})
            return
        if not started:
            started = True
            message = {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(piece.usage),
            }
            yield _event({"type": "message_start", "message": message})
            yield _event({"type": "ping"})
        if piece.kind == "end":
            if open_kind is not None:
                yield _event({"type": "content_block_stop", "index": index})
            reason, sequence = stop_reason(piece.finish_reason, piece.stop_reason)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            yield _event({"type": "message_delta", "delta": delta, "usage": usage(piece.usage)})
            yield _event({"type": "message_stop"})
            return
        if piece.kind == "arguments":
            delta = {"type": "input_json_delta", "partial_json": piece.text}
            block = call_blocks.get(piece.index, index)
            yield _event({"type": "content_block_delta", "index": block, "delta": delta})
            continue
        kind = _BLOCK_KINDS[piece.kind]
        if kind != open_kind or kind == "tool_use":
            if open_kind is not None:
                yield _event({"type": "content_block_stop", "index": index})
            index, open_kind = index + 1, kind
            if kind == "tool_use":
                call_blocks[piece.index] = index
                block = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
            elif kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                block = {"type": "text", "text": ""}
            yield _event({"type": "content_block_start", "index": index, "content_block": block})
        if kind != "tool_use":
            delta_type, field = _DELTA_TYPES[kind]
            delta = {"type": delta_type, field: piece.text}
            yield _event({"type": "content_block_delta", "index": index, "delta": delta})
