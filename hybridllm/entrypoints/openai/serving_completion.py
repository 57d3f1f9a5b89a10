"""POST /v1/completions: one engine request per prompt, streamed as SSE or answered whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.entrypoints.openai.async_engine import RequestStream
from hybridllm.entrypoints.openai.errors import OpenAIError, request_id_of
from hybridllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from hybridllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """The legacy text-completion endpoint; choice index = prompt index * n + sample index."""

    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        model_name = self.check_model(request.model)
        http_id = request_id_of(raw)
        prompts = await self._prompts(request)
        params = []
        for _, prompt_ids in prompts:
            self.check_prompt(prompt_ids)
            max_tokens = self.max_tokens_for(len(prompt_ids), request.max_tokens, "max_tokens")
            params.append(request.to_sampling_params(max_tokens, self.model.vocab_size))
        if params:  # one constraint for all the prompts
            await compile_structured_outputs(self.engine, request, params[0])
        request_id = random_id("cmpl")
        streams = await self.add_all(request_id, [ids for _, ids in prompts], params)
        texts = [text for text, _ in prompts]
        if request.stream:
            body = self._stream(request, request_id, model_name, streams, texts, http_id)
            return AbortingStreamingResponse(body, self.engine, streams)
        try:
            finals = await run_until_disconnected(raw, collect_final(streams))
        finally:
            abort_unfinished(self.engine, streams)
        for final in finals:
            raise_if_failed(final, http_id)
        choices = [
            self._choice(request, pi, out, texts[pi], final, 0, 0, request.echo)[0]
            for pi, final in enumerate(finals)
            for out in sorted(final.outputs, key=lambda c: c.index)
        ]
        usage = _usage(finals)
        response = CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    async def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt, whatever shape the request used; the text is None
        for token-id prompts unless `echo` needs it. Size caps come before any tokenizing."""
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        self.check_request_size(len(prompt), request.n, request.stop)
        if isinstance(prompt[0], str):
            texts = list(prompt)
            return list(zip(texts, await self.tokenize_all(texts, "prompt")))
        ids = [list(p) for p in prompt]
        if not request.echo:
            return [(None, p) for p in ids]
        texts = await self.in_tokenizer_thread(lambda: [self.tokenizer.decode(p) for p in ids])
        return list(zip(texts, ids))

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        out: CompletionOutput,
        prompt_text: str | None,
        final: RequestOutput,
        text_start: int,
        token_start: int,
        echo: bool,
    ) -> tuple[CompletionChoice, int]:
        """The choice for tokens [token_start:] of `out`; also returns the text offset reached."""
        text = out.text[text_start:]
        echoed = (prompt_text or "") if request.echo else ""  # decoded up front when echoed
        prefix = echoed if echo else ""
        logprobs = None
        offset = 0
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo and final.prompt_logprobs is not None:
                offset = self._append_logprobs(
                    logprobs, final.prompt_token_ids, final.prompt_logprobs, 0
                )
            else:
                offset = len(echoed) + text_start
            offset = self._append_logprobs(
                logprobs,
                out.token_ids[token_start:],
                (out.logprobs or [])[token_start:],
                offset,
            )
        choice = CompletionChoice(
            index=prompt_index * (request.n or 1) + out.index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return choice, offset

    def _append_logprobs(
        self,
        into: CompletionLogprobs,
        token_ids: list[int],
        positions: list[dict[int, Logprob] | None],
        offset: int,
    ) -> int:
        for token_id, candidates in zip(token_ids, positions):
            chosen = (candidates or {}).get(token_id)
            token = self.token_text(token_id, chosen)
            into.tokens.append(token)
            into.text_offset.append(offset)
            into.token_logprobs.append(None if chosen is None else chosen.logprob)
            into.top_logprobs.append(
                None
                if candidates is None
                else {self.token_text(t, lp): lp.logprob for t, lp in candidates.items()}
            )
            offset += len(token)
        return offset

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        streams: list[RequestStream],
        texts: list[str | None],
        http_id: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) -> (chars, tokens)
        finished: set[tuple[int, int]] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for pi, output in merge_streams(streams):
                raise_if_failed(output, http_id)
                choices = []
                for out in output.outputs:
                    key = (pi, out.index)
                    if key in finished:
                        continue
                    text_start, token_start = sent.get(key, (0, 0))
                    if len(out.token_ids) == token_start and out.finish_reason is None:
                        continue
                    echo = request.echo and key not in sent
                    choice, _ = self._choice(
                        request, pi, out, texts[pi], output, text_start, token_start, echo
                    )
                    choices.append(choice)
                    sent[key] = (len(out.text), len(out.token_ids))
                    if out.finish_reason is not None:
                        finished.add(key)
                if output.finished:
                    finals[pi] = output
                if choices:
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=model_name, choices=choices
                    )
                    yield sse(chunk)
            if request.include_usage:
                usage = _usage([finals[i] for i in sorted(finals)])
                yield sse(
                    CompletionResponse(
                        id=request_id, created=created, model=model_name, choices=[], usage=usage
                    )
                )
        except Exception as exc:
            yield sse_error(exc, http_id)
        yield SSE_DONE


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
