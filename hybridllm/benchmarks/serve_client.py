"""One benchmark request against an OpenAI-compatible server, timed token by token (aiohttp)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hybridllm.benchmarks.datasets import BenchRequest


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0  # arrival of the first non-empty text
    itl: list[float] = field(default_factory=list)  # gaps between later text chunks
    latency: float = 0.0
    error: str = ""


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
        return self.url.rstrip("/").endswith("chat/completions")

    def payload(self, request: BenchRequest) -> dict[str, Any]:
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
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def send_request(
    session: aiohttp.ClientSession, target: ServerTarget, request: BenchRequest
) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    start = time.perf_counter()
    try:
        async with session.post(
            target.url, json=target.payload(request), headers=target.headers()
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            if target.stream:
                await _read_stream(resp, target, result, start)
            else:
                _read_whole(await resp.json(), target, result)
                result.ttft = time.perf_counter() - start
        result.latency = time.perf_counter() - start
        result.success = not result.error
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_stream(
    resp: aiohttp.ClientResponse, target: ServerTarget, result: RequestResult, start: float
) -> None:
    last = start
    usage_tokens = None
    num_text_chunks = 0
    async for raw_line in resp.content:
        line = raw_line.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or []:
            text = (
                (choice.get("delta") or {}).get("content") if target.is_chat else choice.get("text")
            )
            if not text:
                continue
            now = time.perf_counter()
            if num_text_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            num_text_chunks += 1
            result.generated_text += text
    # Servers that do not report usage: one text chunk per token is the usual streaming shape.
    result.output_tokens = usage_tokens if usage_tokens is not None else num_text_chunks


def _read_whole(body: dict[str, Any], target: ServerTarget, result: RequestResult) -> None:
    choice = (body.get("choices") or [{}])[0]
    result.generated_text = (
        (choice.get("message") or {}).get("content", "")
        if target.is_chat
        else choice.get("text", "")
    )
    result.output_tokens = (body.get("usage") or {}).get("completion_tokens", 0) or 0
