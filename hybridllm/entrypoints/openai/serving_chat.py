"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.entrypoints.openai.async_engine import RequestStream
from hybridllm.entrypoints.openai.chat_parsing import ChatParsing, ReplyParser
from hybridllm.entrypoints.openai.errors import OpenAIError, request_id_of
from hybridllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TokenizeChatRequest,
    TopLogprob,
    UsageInfo,
    random_id,
)
from hybridllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    AbortingStreamingResponse,
    OpenAIServing,
    abort_unfinished,
    collect_final,
    merge_streams,
    raise_if_failed,
    run_until_disconnected,
    sse,
    sse_error,
)
from hybridllm.entrypoints.openai.structured_outputs import compile_structured_outputs
from hybridllm.entrypoints.openai.tool_choice import ToolChoiceConstraint, ToolChoiceEnforcer
from hybridllm.json_limits import loads_strict
from hybridllm.outputs import Logprob, RequestOutput

_MISSING_LOGPROB = -9999.0  # OpenAI's stand-in when a token's logprob is unknown


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint; one engine request whose `n` samples are the choices."""

    def __init__(
        self,
        *args: Any,
        parsing: ChatParsing | None = None,
        tool_choice_enforcer: ToolChoiceEnforcer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.parsing = parsing or ChatParsing()
        # The structured-output engine's hook for tool_choice required / named (tool_choice.py).
        self.tool_choice_enforcer = tool_choice_enforcer

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> Response:
        model_name = self.check_model(request.model)
        self.check_request_size(1, request.n, request.stop)
        if len(request.messages) > self.limits.max_chat_messages:
            raise OpenAIError(
                f"at most {self.limits.max_chat_messages} messages per request, "
                f"got {len(request.messages)}",
                param="messages",
            )
        http_id = request_id_of(raw)
        prompt_ids = await self.render_prompt(request)
        self.check_prompt(prompt_ids, "messages")
        param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = self.max_tokens_for(len(prompt_ids), request.requested_max_tokens, param)
        params = request.to_sampling_params(max_tokens, self.model.vocab_size)
        parser, params = self._reply_parser(request, params)
        await compile_structured_outputs(self.engine, request, params)
        request_id = random_id("chatcmpl")
        streams = await self.add_all(request_id, [prompt_ids], [params])
        if request.stream:
            body = self._stream(request, request_id, model_name, streams, http_id, parser)
            return AbortingStreamingResponse(body, self.engine, streams)
        try:
            (final,) = await run_until_disconnected(raw, collect_final(streams))
        finally:
            abort_unfinished(self.engine, streams)
        raise_if_failed(final, http_id)
        choices = []
        for out in sorted(final.outputs, key=lambda c: c.index):
            parsed = parser.parse(out.text)
            self.engine.metrics.observe_tool_calls(
                len(parsed.tool_calls), self._call_source(request)
            )
            message = ChatResponseMessage(
                content=parsed.content,
                reasoning_content=parsed.reasoning_content,
                tool_calls=list(parsed.tool_calls),
            )
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=message,
                    logprobs=self._logprobs(request, out.token_ids, out.logprobs),
                    finish_reason=_finish_reason(out.finish_reason, len(parsed.tool_calls)),
                    stop_reason=out.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices, usage=_usage(final)
        )
        return JSONResponse(response.model_dump())

    def _reply_parser(self, request: ChatCompletionRequest, params: Any) -> tuple[ReplyParser, Any]:
        """How this request's replies are parsed, and its sampling parameters constrained for
        tool_choice required / named (by the structured-output engine's enforcer)."""
        mode = request.tool_choice_mode()
        if request.tools:
            self.engine.metrics.observe_tool_choice(mode)
        if mode == "auto" and request.tools and self.parsing.tool_call_parser is None:
            raise OpenAIError(
                "tool_choice 'auto' (the default when tools are given) needs the server to run "
                "with --tool-call-parser; or send tool_choice 'none'",
                param="tool_choice",
            )
        constraint = None
        if mode in ("required", "named"):
            if self.tool_choice_enforcer is None:
                raise OpenAIError(
                    f"tool_choice '{mode if mode == 'required' else 'function'}' needs "
                    "structured outputs (constrained decoding), which this server does not "
                    "have yet; use tool_choice 'auto' with --tool-call-parser",
                    param="tool_choice",
                )
            tools = request.tools or []
            if mode == "named":
                wanted = request.tool_choice.function.name
                tools = [t for t in tools if t.function.name == wanted]
            constraint = ToolChoiceConstraint.build(
                [(t.function.name, t.function.parameters) for t in tools], named=mode == "named"
            )
            params = self.tool_choice_enforcer(constraint, params)
        # A parsed call to a function the request did not offer stays text.
        names = [t.function.name for t in request.tools or []]
        return ReplyParser(self.parsing, mode, constraint, tool_names=names), params

    @staticmethod
    def _call_source(request: ChatCompletionRequest) -> str:
        return "parsed" if request.tool_choice in (None, "auto") else "constrained"

    async def render_prompt(
        self, request: ChatCompletionRequest | TokenizeChatRequest
    ) -> list[int]:
        """Messages -> the chat template's text -> token ids (the template adds BOS itself).

        Templates, the model's and a trusted request's alike, render in transformers'
        `apply_chat_template`, i.e. in jinja2's ImmutableSandboxedEnvironment: no dunder
        attributes, no mutation of the data passed in, bounded `range`.
        """
        template = request.chat_template
        if template is not None and not self.limits.trust_request_chat_template:
            raise OpenAIError(
                "chat_template is not accepted by this server (it runs the model's own chat "
                "template; start it with --trust-request-chat-template to allow this field)",
                param="chat_template",
            )
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(
                "the served model has no chat template; use /v1/completions", param="messages"
            )
        kwargs = request.chat_template_kwargs or {}
        # Keys that are apply_chat_template's own arguments would change what runs (a
        # `chat_template` here would bypass the check above), not feed the template.
        reserved = sorted(set(kwargs) & self._reserved_template_kwargs())
        if reserved:
            raise OpenAIError(
                f"chat_template_kwargs may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )
        conversation = [_template_turn(i, message) for i, message in enumerate(request.messages)]
        return await self.in_tokenizer_thread(
            self._render_and_tokenize, conversation, request, template, kwargs
        )

    def _reserved_template_kwargs(self) -> set[str]:
        try:
            names = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        except (TypeError, ValueError, AttributeError):
            names = {"chat_template", "tokenize", "tools", "documents"}
        return (names - {"kwargs"}) | {"messages", "chat_template"}

    def _render_and_tokenize(
        self,
        conversation: list[dict[str, Any]],
        request: ChatCompletionRequest | TokenizeChatRequest,
        template: str | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
        """On the tokenizer thread."""
        continue_final = request.continue_final_message
        if request.tools:  # the template renders the definitions (apply_chat_template's tools=)
            kwargs = {**kwargs, "tools": [t.model_dump(exclude_none=True) for t in request.tools]}
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **kwargs,
            )
        except Exception as exc:  # jinja raise_exception() on e.g. bad role order, sandbox errors
            if template is not None:
                raise OpenAIError(
                    f"the request's chat_template failed: {type(exc).__name__}: {exc}",
                    param="chat_template",
                ) from exc
            raise OpenAIError(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise OpenAIError("the chat template did not render text", param="chat_template")
        self.check_text(text, "messages")
        return self.tokenize_now(text, add_special_tokens=False)

    def _logprobs(
        self,
        request: ChatCompletionRequest,
        token_ids: list[int],
        positions: list[dict[int, Logprob]] | None,
    ) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        top_n = request.top_logprobs or 0
        content = []
        for token_id, candidates in zip(token_ids, positions or []):
            chosen = candidates.get(token_id)
            token = self.token_text(token_id, chosen)
            # Rank order (then logprob) so the top list is the model's, not the dict's, order.
            ranked = sorted(
                candidates.items(),
                key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf, -kv[1].logprob),
            )[:top_n]
            tops = []
            for tid, lp in ranked:
                text = self.token_text(tid, lp)
                tops.append(
                    TopLogprob(token=text, logprob=lp.logprob, bytes=self.token_bytes(tid, text))
                )
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=_MISSING_LOGPROB if chosen is None else chosen.logprob,
                    bytes=self.token_bytes(token_id, token),
                    top_logprobs=tops,
                )
            )
        return ChatChoiceLogprobs(content=content)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        streams: list[RequestStream],
        http_id: str,
        parser: ReplyParser,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        replies = {i: parser.stream() for i in range(request.n or 1)} if parser.active else {}
        n = request.n or 1
        continuous = (
            request.stream_options is not None and request.stream_options.continuous_usage_stats
        )

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=request_id, created=created, model=model_name, choices=choices, usage=usage
                )
            )

        sent: dict[int, tuple[int, int]] = {}  # sample index -> (chars, tokens) already sent
        finished: set[int] = set()
        final: RequestOutput | None = None
        try:
            yield chunk(
                [
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(n)
                ]
            )
            async for _, output in merge_streams(streams):
                raise_if_failed(output, http_id)
                choices = []
                for out in output.outputs:
                    if out.index in finished:
                        continue
                    text_start, token_start = sent.get(out.index, (0, 0))
                    if len(out.token_ids) == token_start and out.finish_reason is None:
                        continue
                    delta = DeltaMessage(content=out.text[text_start:])
                    finish_reason = out.finish_reason
                    reply = replies.get(out.index)
                    if reply is not None:
                        done = out.finish_reason is not None
                        text = out.text[text_start:]
                        delta = reply.finish(text) if done else reply.feed(text)
                        if done:
                            finish_reason = _finish_reason(finish_reason, reply.num_calls)
                            self.engine.metrics.observe_tool_calls(
                                reply.num_calls, self._call_source(request)
                            )
                    choices.append(
                        ChatStreamChoice(
                            index=out.index,
                            delta=delta,
                            logprobs=self._logprobs(
                                request,
                                out.token_ids[token_start:],
                                (out.logprobs or [])[token_start:],
                            ),
                            finish_reason=finish_reason,
                            stop_reason=out.stop_reason,
                        )
                    )
                    sent[out.index] = (len(out.text), len(out.token_ids))
                    if out.finish_reason is not None:
                        finished.add(out.index)
                if output.finished:
                    final = output
                if choices:
                    yield chunk(choices, _usage(output) if continuous else None)
            if request.include_usage and final is not None:
                yield chunk([], _usage(final))
        except Exception as exc:
            yield sse_error(exc, http_id)
        yield SSE_DONE


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    # OpenAI's: a reply that ended by itself with calls in it ends for the calls; a cut-off one
    # (length) says so.
    return "tool_calls" if num_calls and reason == "stop" else reason


def _template_turn(index: int, message: Any) -> dict[str, Any]:
    """One message as chat templates read it: tool calls with their arguments as objects
    (the Qwen, Llama and Hermes templates serialize `arguments` themselves)."""
    turn: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name:
        turn["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise OpenAIError(
                f"messages[{index}]: only assistant messages carry tool_calls",
                param=f"messages.{index}.tool_calls",
            )
        calls = []
        for j, call in enumerate(message.tool_calls):
            field = f"messages[{index}].tool_calls[{j}].function.arguments"
            param = f"messages.{index}.tool_calls.{j}.function.arguments"
            try:
                # Depth-checked before parsing: json.loads recurses once per level, and a deep
                # text ran it out of stack (a 500); NaN and Infinity are not JSON either.
                arguments = loads_strict(call.function.arguments)
            except ValueError as exc:
                raise OpenAIError(
                    f"{field} must be a JSON object as text: {exc}", param=param
                ) from None
            if not isinstance(arguments, dict):
                raise OpenAIError(f"{field} must be a JSON object as text", param=param)
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        turn["tool_calls"] = calls
    if message.role == "tool":
        if not message.tool_call_id:
            raise OpenAIError(
                f"messages[{index}]: a tool message needs the tool_call_id it answers",
                param=f"messages.{index}.tool_call_id",
            )
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _usage(output: RequestOutput) -> UsageInfo:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
