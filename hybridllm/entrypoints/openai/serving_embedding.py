"""POST /v1/embeddings: pooled, normalized final hidden states of the served model."""

from __future__ import annotations

import array
import base64
import sys
from concurrent.futures import Executor
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.errors import OpenAIError, from_value_error
from hybridllm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageInfo,
)
from hybridllm.entrypoints.openai.serving_base import (
    OpenAIServing,
    RequestLimits,
    ServedModel,
    run_until_disconnected,
)
from hybridllm.entrypoints.openai.token_table import TokenTable

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        model: ServedModel,
        pooling: str,
        tokenizer_pool: Executor | None = None,
        limits: RequestLimits | None = None,
        tokens: TokenTable | None = None,
    ) -> None:
        super().__init__(engine, tokenizer, model, tokenizer_pool, limits, tokens)
        self.pooling = pooling  # "last" | "mean"

    async def create_embedding(self, request: EmbeddingRequest, raw: Request) -> Response:
        model_name = self.check_model(request.model)
        if request.dimensions is not None:
            raise OpenAIError("dimensions is not supported by this model", param="dimensions")
        prompts = await self._inputs(request.input)
        for prompt_ids in prompts:
            self.check_prompt(prompt_ids, "input")
        try:
            vectors = await run_until_disconnected(
                raw, self.engine.embed(prompts, pooling=self.pooling, normalize=True)
            )
        except ValueError as exc:
            raise from_value_error(exc) from exc
        data = [
            EmbeddingData(index=i, embedding=_encode(vector, request.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        num_tokens = sum(len(p) for p in prompts)
        usage = UsageInfo(prompt_tokens=num_tokens, completion_tokens=None, total_tokens=num_tokens)
        response = EmbeddingResponse(model=model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump(exclude={"usage": {"completion_tokens"}}))

    async def _inputs(self, inputs: object) -> list[list[int]]:
        if isinstance(inputs, str):
            return await self.tokenize_all([inputs], "input")
        if not inputs:
            raise OpenAIError("input must not be empty", param="input")
        if isinstance(inputs[0], int):
            return [list(inputs)]
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise OpenAIError(
                f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(inputs)}",
                param="input",
            )
        if isinstance(inputs[0], str):
            return await self.tokenize_all(list(inputs), "input")
        return [list(ids) for ids in inputs]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    # base64 of little-endian float32, what the openai client decodes with numpy.frombuffer.
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
