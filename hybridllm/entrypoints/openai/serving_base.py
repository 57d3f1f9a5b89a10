"""What every OpenAI endpoint shares: model check, tokenization, context limits, SSE, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from hybridllm.entrypoints.openai.errors import (
    ClientDisconnected,
    EngineDeadError,
    OpenAIError,
    error_body,
    from_value_error,
)
from hybridllm.outputs import Logprob, RequestOutput

T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """The one model this server answers for, under the names a client may use."""

    names: tuple[str, ...]  # names[0] is reported back in responses
    path: str
    max_model_len: int
    vocab_size: int


class OpenAIServing:
    """Base of the completion, chat and embedding handlers."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, model: ServedModel) -> None:
        self.engine = engine
        self.tokenizer = tokenizer  # the server's own copy: HF fast tokenizers are not thread-safe
        self.model = model

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model.names and name != self.model.path:
            raise OpenAIError(
                f"the model '{name}' does not exist; this server serves '{self.model.names[0]}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return self.model.names[0]

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise OpenAIError(f"{param} must not be empty", param=param)
        limit = self.model.max_model_len
        if len(token_ids) >= limit:
            raise OpenAIError(
                f"this model's maximum context length is {limit} tokens, but the {param} has "
                f"{len(token_ids)} tokens (at least one token must be left for the output)",
                param=param,
                code="context_length_exceeded",
            )
        vocab = self.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The requested output budget, or what is left of the context; over-long asks are 400s."""
        room = self.model.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise OpenAIError(
                f"this model's maximum context length is {self.model.max_model_len} tokens, "
                f"but {num_prompt_tokens + requested} were requested ({num_prompt_tokens} in the "
                f"prompt, {requested} for the output); lower {param}",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    async def add_all(
        self, request_id: str, prompts: list[list[int]], params: list[Any]
    ) -> list[RequestStream]:
        """Queue one engine request per prompt; if one is refused, none stays queued."""
        streams: list[RequestStream] = []
        try:
            for index, (prompt_ids, sampling) in enumerate(zip(prompts, params)):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(await self.engine.add_request(sub_id, prompt_ids, sampling))
        except ValueError as exc:  # the engine's own checks: bad tokens, length
            abort_unfinished(self.engine, streams)
            error = from_value_error(exc)
            error.param = error.param or "prompt"
            raise error from exc
        except BaseException:
            abort_unfinished(self.engine, streams)
            raise
        return streams


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the 200 was sent: the stream carries it as an OpenAI-style event."""
    if isinstance(exc, OpenAIError):
        body = error_body(exc.message, exc.status, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(f"the engine is not running: {exc}", 503, code="engine_dead")
    else:
        body = error_body(f"internal server error: {type(exc).__name__}: {exc}", 500)
    return sse(body)


def raise_if_failed(output: RequestOutput) -> None:
    if output.error or any(c.finish_reason == "error" for c in output.outputs):
        raise OpenAIError(f"generation failed: {output.error or 'engine error'}", status=500)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as they come; leaving early aborts them all."""
    if len(streams) == 1:
        async with streams[0]:
            async for output in streams[0]:
                yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async with stream:
                async for output in stream:
                    merged.put_nowait((index, output))
        except Exception as exc:
            merged.put_nowait((index, exc))
        merged.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled pump aborts its request in `async with stream`
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of each request, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        finals[index] = output
    return [f for f in finals if f is not None]


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class AbortingStreamingResponse(StreamingResponse):
    """SSE response that aborts its unfinished requests however the stream ends.

    The body generator's own cleanup covers most exits; this also covers a stream torn down
    before its generator ever ran (the client left while the headers were being sent).
    """

    def __init__(
        self, content: AsyncIterator[str], engine: AsyncEngine, streams: list[RequestStream]
    ):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._engine = engine
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._engine, self._streams)


def abort_unfinished(engine: AsyncEngine, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            engine.abort(stream.request_id)
