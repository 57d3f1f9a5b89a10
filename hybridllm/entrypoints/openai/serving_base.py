"""What every OpenAI endpoint shares: model check, tokenization, limits, SSE, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybridllm.engine.errors import EngineDeadError
from hybridllm.engine.input_validation import InputValidator, InvalidInputError
from hybridllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from hybridllm.entrypoints.openai.errors import (
    ClientDisconnected,
    OpenAIError,
    engine_dead_message,
    error_body,
    from_value_error,
    internal_error_message,
)
from hybridllm.entrypoints.openai.token_table import TokenTable
from hybridllm.outputs import Logprob, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """The one model this server answers for, under the names a client may use."""

    names: tuple[str, ...]  # names[0] is reported back in responses
    path: str
    max_model_len: int
    vocab_size: int
    root: str | None = None  # what /v1/models reports as `root`; None: the path


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request's size, checked before anything is queued (400s naming the field)."""

    max_prompts_per_request: int = 64
    max_request_work: int = 256  # n x prompts: the engine sequences one request may start
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_chat_messages: int = 2048
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_prompts_per_request",
            "max_request_work",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_chat_messages",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class OpenAIServing:
    """Base of the completion, chat and embedding handlers.

    Everything that uses the tokenizer runs on `tokenizer_pool`, one thread shared by all
    handlers: HF fast tokenizers are not thread-safe, and a long prompt must not stall the
    event loop (the Rust tokenizer releases the GIL while it works).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        model: ServedModel,
        tokenizer_pool: Executor | None = None,
        limits: RequestLimits | None = None,
        tokens: TokenTable | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer  # the server's own copy, used only on tokenizer_pool
        self.model = model
        self.tokenizer_pool = tokenizer_pool
        self.limits = limits or RequestLimits()
        self.tokens = tokens  # per-token text and bytes, read on the event loop
        # The engine's own checks, made here to answer 400 before anything is queued.
        self.validator = InputValidator(model.max_model_len, model.vocab_size)
        chars_per_token = tokens.max_token_chars if tokens is not None else None
        # A text longer than this needs more tokens than the context holds: refused untokenized.
        self.max_text_chars = (
            None if chars_per_token is None else model.max_model_len * chars_per_token
        )

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the tokenizer thread (the only thread that uses the tokenizer)."""
        if self.tokenizer is None:
            raise OpenAIError("this server has no tokenizer: send token ids", param="prompt")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model.names and name != self.model.path:
            raise OpenAIError(
                f"the model '{name}' does not exist; this server serves '{self.model.names[0]}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return self.model.names[0]

    def check_text(self, text: str, param: str) -> None:
        """Refuse a text too long for the context whatever it tokenizes to, before tokenizing."""
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise OpenAIError(
                f"the {param} has {len(text)} characters, more than a context of "
                f"{self.model.max_model_len} tokens can hold",
                param=param,
                code="context_length_exceeded",
            )

    def tokenize_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on the calling thread: only for code already on the tokenizer thread."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def tokenize_all(
        self, texts: list[str], param: str, add_special_tokens: bool = True
    ) -> list[list[int]]:
        for text in texts:
            self.check_text(text, param)
        return await self.in_tokenizer_thread(
            lambda: [self.tokenize_now(text, add_special_tokens) for text in texts]
        )

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.in_tokenizer_thread(self.tokenizer.decode, token_ids)

    def check_request_size(self, num_prompts: int, n: int | None, stop: Any) -> None:
        """The configured caps on prompts, samples and stop strings."""
        limits = self.limits
        if num_prompts > limits.max_prompts_per_request:
            raise OpenAIError(
                f"at most {limits.max_prompts_per_request} prompts per request, got {num_prompts}",
                param="prompt",
            )
        work = num_prompts * (n or 1)
        if work > limits.max_request_work:
            raise OpenAIError(
                f"n x prompts is {work}, more than this server's limit of "
                f"{limits.max_request_work} sequences per request",
                param="n",
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > limits.max_stop_strings:
            raise OpenAIError(
                f"at most {limits.max_stop_strings} stop strings, got {len(stops)}", param="stop"
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_string_chars:
            raise OpenAIError(
                f"stop strings may have at most {limits.max_stop_string_chars} characters, "
                f"got one of {longest}",
                param="stop",
            )

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        """The engine's prompt checks (engine/input_validation.py) as a 400 naming `param`."""
        try:
            self.validator.check_prompt(token_ids, param)
        except InvalidInputError as exc:
            raise from_value_error(exc) from exc

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The requested output budget, or what is left of the context; over-long asks are 400s."""
        try:
            return self.validator.output_budget(num_prompt_tokens, requested, param)
        except InvalidInputError as exc:
            raise from_value_error(exc) from exc

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokens.text(token_id) if self.tokens is not None else str(token_id)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own UTF-8 bytes (a piece of a multibyte character stays a piece)."""
        return self.tokens.token_bytes(token_id) if self.tokens is not None else list(text.encode())

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


def sse_error(exc: BaseException, request_id: str) -> str:
    """An error after the 200 was sent: the stream carries it as an OpenAI-style event."""
    if isinstance(exc, OpenAIError):
        body = error_body(exc.message, exc.status, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(engine_dead_message(str(exc)), 503, code="engine_dead")
    else:
        logger.error("stream failed (request id %s)", request_id, exc_info=exc)
        body = error_body(internal_error_message(request_id), 500, code="internal_error")
    return sse(body)


def raise_if_failed(output: RequestOutput, request_id: str) -> None:
    """A request the engine failed: 400 saying why when its own input was the cause, else a
    500 that names only the request id (the reason goes to the log)."""
    if not (output.error or any(c.finish_reason == "error" for c in output.outputs)):
        return
    reason = output.error or ""
    if output.error_from_request:  # its reason is the client's to read; any other is internal
        raise OpenAIError(f"the request cannot run: {reason}", param="prompt")
    logger.error(
        "engine request %s failed (request id %s): %s",
        output.request_id,
        request_id,
        reason or "no reason given",
    )
    raise OpenAIError(internal_error_message(request_id), status=500, code="internal_error")


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as they come; leaving early aborts them all.

    Reads a stream only when the consumer asks for more, so a slow consumer leaves each
    stream's bounded buffer to coalesce outputs instead of queueing them here.
    """
    if len(streams) == 1:
        async with streams[0]:
            async for output in streams[0]:
                yield 0, output
        return
    pending: dict[asyncio.Future, int] = {}

    def read_next(index: int) -> None:
        pending[asyncio.ensure_future(streams[index].__anext__())] = index

    async with contextlib.AsyncExitStack() as stack:
        for stream in streams:
            await stack.enter_async_context(stream)  # aborts its request if left unfinished
        for index in range(len(streams)):
            read_next(index)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    index = pending.pop(task)
                    try:
                        output = task.result()
                    except StopAsyncIteration:
                        continue
                    yield index, output
                    read_next(index)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


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
