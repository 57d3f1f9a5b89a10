"""OpenAI Responses API: request models, their chat-completions form, output items, responses."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from hybridllm.entrypoints.openai.protocol import FUNCTION_NAME_PATTERN


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesModel(BaseModel):
    # Strict: a string where a number belongs is a 400. Unknown fields (include, reasoning,
    # truncation, service_tier, ...) are ignored: clients send extras.
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class TextPart(ResponsesModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(ResponsesModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(ResponsesModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(ResponsesModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(ResponsesModel):
    """A previous reply's reasoning, sent back by clients; chat templates have no place for it."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    # A message may leave out its type (OpenAI's "easy input message").
    kind = value.get("type", "message") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a message (input_text / output_text content), "
        "function_call, function_call_output or reasoning",
    ),
]


class FunctionTool(ResponsesModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(ResponsesModel):
    type: Literal["function"]
    name: str


class TextFormat(ResponsesModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(ResponsesModel):
    format: TextFormat | None = None


class ResponsesRequest(ResponsesModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: function calls join the assistant turn before them,
    each function_call_output is a `tool` message."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    out: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
    return out


def chat_body(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body the request runs as (validated there as any chat request)."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"messages": system + conversation, "stream": request.stream}
    if request.stream:  # the final chunk's usage goes into response.completed
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if request.tools is not None:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type != "text":
        body["response_format"] = {"type": text_format.type}
        if text_format.type == "json_schema":
            body["response_format"]["json_schema"] = {
                "name": text_format.name or "response",
                "schema": text_format.json_schema,
                "strict": text_format.strict,
            }
    optional = {
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "user": request.user,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_items(reply: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """A chat reply message -> output items: reasoning, then the text, then the calls."""
    items = []
    if reply.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), reply["reasoning_content"]))
    if reply.get("content"):
        items.append(message_item(new_id("msg"), reply["content"]))
    for call in reply.get("tool_calls") or []:
        function = call["function"]
        item_id = new_id("fc")
        items.append(
            function_call_item(item_id, call["id"], function["name"], function["arguments"])
        )
    if items and finish_reason == "length":  # the item that was cut off
        items[-1]["status"] = "incomplete"
    return items


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the chat message a continuation replays (reasoning is not replayed)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in items
        if i["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text or None, "tool_calls": calls or None}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    chat_usage = chat_usage or {}
    prompt, completion = (
        chat_usage.get("prompt_tokens") or 0,
        chat_usage.get("completion_tokens") or 0,
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    chat_usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object, echoing the request's settings as OpenAI does."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tool_choice": (
            request.tool_choice.model_dump()
            if isinstance(request.tool_choice, FunctionChoice)
            else request.tool_choice or "auto"
        ),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "text": (
            request.text.model_dump(by_alias=True, exclude_none=True)
            if request.text is not None and request.text.format is not None
            else {"format": {"type": "text"}}
        ),
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "user": request.user,
        "usage": usage(chat_usage) if status != "in_progress" else None,
    }
