"""Anthropic Messages API: request models, their chat-completions form, replies and errors."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.entrypoints.openai.protocol import FUNCTION_NAME_PATTERN


class AnthropicModel(BaseModel):
    # Strict: a string where a number belongs is a 400, as Anthropic answers. Unknown fields
    # (cache_control, container, service_tier, ...) are ignored: clients send extras.
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(AnthropicModel):
    """A previous turn's reasoning, sent back by clients; templates get no place for it."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    # Anthropic's server tools (web search, bash, ...) have other types: nothing here runs them.
    type: Literal["custom"] | None = None


class ToolChoiceAuto(AnthropicModel):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(AnthropicModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceTool, Field(discriminator="type")]


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: OutputFormat | None = None  # (`effort` means nothing to these models: ignored)


class Metadata(AnthropicModel):
    user_id: str | None = None


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    stream: bool = False


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(block.text for block in blocks)


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool_use blocks become an assistant's tool_calls and
    each tool_result a `tool` message, in the order they came."""
    out: list[dict[str, Any]] = []
    if request.system is not None:
        out.append({"role": "system", "content": _text(request.system)})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        allowed = ("text",)
        if message.role == "assistant":
            allowed = ("text", "tool_use", "thinking", "redacted_thinking")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            if block.type not in allowed and block.type != "tool_result":
                raise OpenAIError(
                    f"messages.{i}.content.{j}: a {message.role} message cannot hold a "
                    f"{block.type} block",
                    param=f"messages.{i}.content.{j}.type",
                )
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ToolUseBlock):
                function = {"name": block.name, "arguments": json.dumps(block.input)}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise OpenAIError(
                        f"messages.{i}.content.{j}: tool_result blocks belong in user messages",
                        param=f"messages.{i}.content.{j}.type",
                    )
                if text:  # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        if message.role == "assistant":
            out.append(
                {"role": "assistant", "content": "".join(text) or None, "tool_calls": calls or None}
            )
        elif text or not message.content:  # a user turn of only tool results adds no text
            out.append({"role": "user", "content": "".join(text)})
    return out


def chat_body(request: CountTokensRequest) -> dict[str, Any]:
    """The chat-completions body the request runs as (validated there as any chat request)."""
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request)}
    if request.tools is not None:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceTool):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not isinstance(request, MessagesRequest):
        return body
    body["max_tokens"] = request.max_tokens
    body["stream"] = request.stream
    if request.stream:  # usage in every chunk: message_start reports the prompt's tokens
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    optional = {
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "user": request.metadata.user_id if request.metadata else None,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    output_format = request.output_config.format if request.output_config else None
    if output_format is not None:  # structured outputs, as response_format does on chat
        schema = {"name": "output", "schema": output_format.json_schema, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def stop_reason(finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """Chat's finish_reason and stop_reason -> Anthropic's stop_reason and stop_sequence."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):  # the stop string that matched (a token id means EOS)
        return "stop_sequence", stop
    return "end_turn", None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    chat_usage = chat_usage or {}
    return {
        "input_tokens": chat_usage.get("prompt_tokens") or 0,
        "output_tokens": chat_usage.get("completion_tokens") or 0,
    }


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.split("-", 1)[-1]  # the chat id's hex: one id in the log and reply


def message_from_chat(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body -> an Anthropic message."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""}
        )
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {
        "id": message_id(chat["id"]),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    }


# Anthropic's error types by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(message: str, status: int) -> dict[str, Any]:
    default = "api_error" if status >= 500 else "invalid_request_error"
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(status, default), "message": message},
    }


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)
