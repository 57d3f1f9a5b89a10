"""The OpenAI-compatible HTTP server: FastAPI app factory, its CLI flags, and the uvicorn runner."""

from __future__ import annotations

import argparse
import copy
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from hybridllm.entrypoints.logging_config import LOG_LEVELS, configure_logging
from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from hybridllm.entrypoints.openai.middleware import add_middlewares
from hybridllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)
from hybridllm.entrypoints.openai.serving_base import ServedModel
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat
from hybridllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from hybridllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a full 128k-token prompt as JSON fits with room


@dataclass(frozen=True)
class ServerOptions:
    """Server settings that are not engine settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    pooling: str = "last"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("hybridllm")
    except Exception:  # not pip-installed: running from a checkout
        import hybridllm

        return getattr(hybridllm, "__version__", "0.1.0+checkout")


def build_app(
    engine: AsyncEngine, tokenizer: Any, model: ServedModel, options: ServerOptions
) -> FastAPI:
    """The ASGI app; `engine` starts with the app's lifespan and is shut down with it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        logger.info("engine thread started; serving '%s' (%s)", model.names[0], model.path)
        yield
        logger.info(
            "shutting down: finishing running requests (up to %.0f s)", options.shutdown_timeout
        )
        await engine.shutdown(options.shutdown_timeout)
        logger.info("engine stopped")

    # strict_content_type=False: curl -d without a JSON content type still works.
    app = FastAPI(
        title="hybridllm", version=server_version(), lifespan=lifespan, strict_content_type=False
    )
    install_error_handlers(app)
    add_middlewares(app, engine.metrics, options.api_key, options.max_request_bytes)
    completion = OpenAIServingCompletion(engine, tokenizer, model)
    chat = OpenAIServingChat(engine, tokenizer, model)
    embedding = OpenAIServingEmbedding(engine, tokenizer, model, options.pooling)
    card = ModelCard(id=model.names[0], root=model.path, max_model_len=model.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(
            f"the engine is not running: {engine.dead_reason}", 503, code="engine_dead"
        )

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": server_version()})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await engine.get_stats()
        text = engine.metrics.render(stats, engine.is_healthy, engine.num_in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [card.model_copy(update={"id": name}) for name in model.names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in model.names:
            raise OpenAIError(
                f"the model '{model_id}' does not exist", 404, param="model", code="model_not_found"
            )
        return JSONResponse(card.model_copy(update={"id": model_id}).model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await completion.create_completion(request, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(request, raw)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await embedding.create_embedding(request, raw)

    return app


def add_server_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)",
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYBRIDLLM_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use for the model (default: the model path's basename)",
    )
    g.add_argument(
        "--pooling",
        choices=("last", "mean"),
        default="last",
        help="how /v1/embeddings pools the final hidden states (default last)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are refused with 413 (default 8 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish after SIGINT/SIGTERM (default 10)",
    )
    g.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="logging level (default: $HYBRIDLLM_LOGGING_LEVEL or info)",
    )
    return parser


def served_model_names(args_names: list[str] | None, model_path: str) -> tuple[str, ...]:
    if args_names:
        return tuple(args_names)
    return (os.path.basename(model_path.rstrip("/")) or model_path,)


def run_server(args: argparse.Namespace) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM (uvicorn drains, then the lifespan ends)."""
    import uvicorn

    from hybridllm.engine.llm_engine import LLMEngine
    from hybridllm.engine_args import EngineArgs

    configure_logging(args.log_level)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("HYBRIDLLM_API_KEY") or None,
        pooling=args.pooling,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    engine_args = EngineArgs.from_cli_args(args)
    async_engine = AsyncEngine.launch(lambda: LLMEngine.from_engine_args(engine_args))
    engine = async_engine.engine
    config = engine.model_config
    model = ServedModel(
        names=served_model_names(args.served_model_name, config.model),
        path=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
    )
    # The engine thread detokenizes with its tokenizer; the event loop gets its own copy.
    tokenizer = copy.deepcopy(engine.get_tokenizer())
    app = build_app(async_engine, tokenizer, model, options)
    logger.info(
        "listening on http://%s:%d (model '%s')", options.host, options.port, model.names[0]
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_config=None,  # keep our logging setup
        access_log=False,  # AccessLogMiddleware writes one line per request, with latency
        timeout_graceful_shutdown=options.shutdown_timeout,
        lifespan="on",
    )
    uvicorn.Server(uvicorn_config).run()
