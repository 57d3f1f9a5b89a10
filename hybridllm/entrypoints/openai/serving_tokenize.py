"""POST /tokenize and /detokenize (vLLM's shapes), on the server's tokenizer thread."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from hybridllm.engine.input_validation import InvalidInputError
from hybridllm.entrypoints.openai.errors import OpenAIError, from_value_error
from hybridllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from hybridllm.entrypoints.openai.serving_base import OpenAIServing
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat


def parse_tokenize_request(body: Any) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """vLLM's rule: a body with `messages` is a chat request, any other a prompt; invalid
    fields are FastAPI's validation error (a 400 naming the field), as on every endpoint."""
    if isinstance(body, dict) and "messages" in body and "prompt" in body:
        # Either one would be ignored silently, and the count would not be the one asked for.
        raise OpenAIError(
            "give either messages (a chat) or prompt (a text), not both", param="prompt"
        )
    model = (
        TokenizeChatRequest
        if isinstance(body, dict) and "messages" in body
        else TokenizeCompletionRequest
    )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        ) from None


class OpenAIServingTokenization(OpenAIServing):
    """Counts and ids for clients that budget their prompts; the chat form renders through the
    chat endpoint's template path, so the ids are the ones a chat request would run."""

    def __init__(self, *args: Any, chat: OpenAIServingChat, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def create_tokenize(
        self, request: TokenizeChatRequest | TokenizeCompletionRequest
    ) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            if len(request.messages) > self.limits.max_chat_messages:
                raise OpenAIError(
                    f"at most {self.limits.max_chat_messages} messages per request, "
                    f"got {len(request.messages)}",
                    param="messages",
                )
            # The ids a chat request would run: the template places its own special tokens.
            ids = await self.chat.render_prompt(request)
        else:
            (ids,) = await self.tokenize_all(
                [request.prompt], "prompt", add_special_tokens=request.add_special_tokens
            )
        strs = [self.token_text(t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.model.max_model_len, tokens=ids, token_strs=strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        limit = self.model.max_model_len
        if len(request.tokens) > limit:
            raise OpenAIError(
                f"at most {limit} tokens (the context length), got {len(request.tokens)}",
                param="tokens",
            )
        try:
            self.validator.check_token_ids(request.tokens, "tokens")
        except InvalidInputError as exc:
            raise from_value_error(exc) from exc
        text = await self.in_tokenizer_thread(self.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
