"""One benchmark request against an OpenAI-compatible server, timed token by token (aiohttp)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hybridllm.benchmarks.datasets import BenchRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0  # arrival of the first delta that carries generated text
    itl: list[float] = field(default_factory=list)  # gaps between later text deltas
    latency: float = 0.0
    error: str = ""  # why it failed; identical causes give identical text, so they can be counted


@dataclass(frozen=True)
class ServerTarget:
    """Where and how to send: the URL of the endpoint and the fixed parts of every payload."""

    url: str  # e.g. http://127.0.0.1:8000/v1/completions
    model: str
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: tuple[tuple[str, Any], ...] = ()  # more request fields, e.g. logit_bias

    @property
    def is_chat(self) -> bool:
        """Whether the URL is a chat completions endpoint (messages in, deltas out)."""
        return self.url.rstrip("/").endswith("chat/completions")

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body of one request: the prompt as `prompt` or as one user message."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": self.temperature,
            "stream": self.stream,
        }
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension; servers without it ignore the field
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        """The bearer-token header, when there is a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def send_request(
    session: aiohttp.ClientSession, target: ServerTarget, request: BenchRequest
) -> RequestResult:
    """Send one request and time it; any failure ends up in `error`, never raised, never retried.

    A retry could run a request twice on the server (and count it once), so a request that fails
    for any reason, before or after it reached the server, is reported as failed.
    """
    result = RequestResult(prompt_len=request.prompt_len)
    start = time.perf_counter()
    try:
        async with session.post(
            target.url, json=target.payload(request), headers=target.headers()
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return result
            if target.stream:
                await _read_stream(resp, target, result, start)
            else:
                _read_whole(await resp.json(), target, result)
                result.ttft = time.perf_counter() - start
        result.latency = time.perf_counter() - start
        result.success = not result.error
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        # The exception's text is the reason; aiohttp's own messages carry no per-request detail.
        result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return result


def _error_message(body: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body's start."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:MAX_ERROR_CHARS]
    except (ValueError, AttributeError):
        pass
    return body[:MAX_ERROR_CHARS]


def _delta_text(choice: dict[str, Any], is_chat: bool) -> str:
    if not is_chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # A reasoning model's thinking is generated tokens too: its first one is the first token,
    # whichever field a server puts it in. The role-only first delta carries no text.
    return (delta.get("content") or "") + (
        delta.get("reasoning_content") or delta.get("reasoning") or ""
    )


async def _read_stream(
    resp: aiohttp.ClientResponse, target: ServerTarget, result: RequestResult, start: float
) -> None:
    last = start
    usage_tokens = None
    num_text_deltas = 0
    finished = False
    async for raw_line in resp.content:
        line = raw_line.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, `event:` and `:` comment lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            finished = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            result.error = f"error event: {message}"[:MAX_ERROR_CHARS]
            return
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                finished = True
            text = _delta_text(choice, target.is_chat)
            if not text:
                continue
            now = time.perf_counter()
            if num_text_deltas == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            num_text_deltas += 1
            result.generated_text += text
    if not finished:
        # A connection closed between events ends the body cleanly for a server that sent no
        # length: without a finish reason or [DONE], the reply was cut short.
        result.error = "stream ended before a finish_reason or [DONE]"
        return
    # Usage is the server's own count. Without it, one text delta per token is the usual shape.
    result.output_tokens = usage_tokens if usage_tokens is not None else num_text_deltas


def _read_whole(body: dict[str, Any], target: ServerTarget, result: RequestResult) -> None:
    choice = (body.get("choices") or [{}])[0]
    result.generated_text = (
        (choice.get("message") or {}).get("content", "")
        if target.is_chat
        else choice.get("text", "")
    ) or ""
    result.output_tokens = (body.get("usage") or {}).get("completion_tokens", 0) or 0
