"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner (its flags:
server_args.py)."""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from hybridllm.entrypoints.openai.async_engine import AsyncEngine
from hybridllm.entrypoints.openai.chat_parsing import ChatParsing
from hybridllm.entrypoints.openai.errors import (
    OpenAIError,
    engine_dead_message,
    error_response,
    install_error_handlers,
)
from hybridllm.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hybridllm.entrypoints.openai.middleware import add_middlewares
from hybridllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)
from hybridllm.entrypoints.openai.serving_base import RequestLimits, ServedModel
from hybridllm.entrypoints.openai.serving_chat import OpenAIServingChat
from hybridllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from hybridllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from hybridllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from hybridllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from hybridllm.entrypoints.openai.serving_tokenize import (
    OpenAIServingTokenization,
    parse_tokenize_request,
)
from hybridllm.entrypoints.openai.structured_outputs import enforce_tool_choice
from hybridllm.entrypoints.openai.token_table import TokenTable
from hybridllm.entrypoints.openai.tool_choice import ToolChoiceEnforcer
from hybridllm.entrypoints.openai.web_routes import add_web_routes, sample_live_stats

if TYPE_CHECKING:
    from hybridllm.engine_args import EngineArgs

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3  # the engine died while serving (a worker died, a device error)
_ANSWER_MARGIN_S = 5.0  # after the drain, for failed requests' answers to go out
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a full 128k-token prompt as JSON fits with room
_DEFAULT_LIMITS = RequestLimits()


@dataclass(frozen=True)
class ServerOptions:
    """Server settings that are not engine settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    pooling: str = "last"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = 10.0
    # Per-request caps (see RequestLimits).
    max_prompts_per_request: int = _DEFAULT_LIMITS.max_prompts_per_request
    max_request_work: int = _DEFAULT_LIMITS.max_request_work
    max_stop_strings: int = _DEFAULT_LIMITS.max_stop_strings
    max_stop_string_chars: int = _DEFAULT_LIMITS.max_stop_string_chars
    max_chat_messages: int = _DEFAULT_LIMITS.max_chat_messages
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None  # hermes | llama3_json: tool calls for tool_choice auto
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think> -> reasoning_content
    # Connection limits, enforced by uvicorn and our h11 protocol / body middleware.
    limit_concurrency: int = 1024  # connections + requests; the excess get uvicorn's 503
    timeout_keep_alive: float = 5.0  # idle kept-alive connections close after this
    max_header_bytes: int = 16 * 1024  # request line + headers (h11's incomplete event size)
    request_read_timeout: float = 30.0  # headers, and each piece of the body, within this
    ui: bool = True  # the web page at / (--no-ui: off)

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in ("timeout_keep_alive", "request_read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        _ = self.limits  # RequestLimits validates the caps: now, not at the first request
        _ = self.parsing  # ChatParsing checks the parser names

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_prompts_per_request=self.max_prompts_per_request,
            max_request_work=self.max_request_work,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_chars=self.max_stop_string_chars,
            max_chat_messages=self.max_chat_messages,
            trust_request_chat_template=self.trust_request_chat_template,
        )

    @property
    def parsing(self) -> ChatParsing:
        return ChatParsing(self.tool_call_parser, self.reasoning_parser)

    @property
    def exposed_without_key(self) -> bool:
        """Bound beyond this machine (not loopback) with no API key."""
        return self.api_key is None and not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def embedded_model_name() -> str:
    """The embedded model's short name: its file name without quantization and extension."""
    from hybridllm.loader.default_model import DEFAULT_MODEL_FILE

    return DEFAULT_MODEL_FILE.split(".", 1)[0]


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("hybridllm")
    except Exception:  # not pip-installed: running from a checkout
        import hybridllm

        return getattr(hybridllm, "__version__", "0.1.0+checkout")


def build_app(
    engine: AsyncEngine,
    tokenizer: Any,
    model: ServedModel,
    options: ServerOptions,
    tool_choice_enforcer: ToolChoiceEnforcer | None = None,
    plan_report: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The ASGI app; `engine` starts with the app's lifespan and is shut down with it.

    `tool_choice_enforcer`: constrains replies for tool_choice required / named (the server
    passes structured_outputs.enforce_tool_choice); without it those choices are a 400.
    `plan_report`: makes the JSON of the served placement plan (/v1/plan, the web page).
    """

    # The one thread that uses the tokenizer (HF fast tokenizers are not thread-safe).
    tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridllm-tokenizer")
    tokens = TokenTable.build(tokenizer) if tokenizer is not None else None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        logger.info("engine thread started; serving '%s' (%s)", model.names[0], model.path)
        sampler = asyncio.create_task(sample_live_stats(engine))
        try:
            yield
            sampler.cancel()  # no samples while the engine drains
            logger.info(
                "shutting down: finishing running requests (up to %.0f s)",
                options.shutdown_timeout,
            )
            await engine.shutdown(options.shutdown_timeout)
            logger.info("engine stopped")
        finally:
            sampler.cancel()
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # strict_content_type=False: a body sent with no content type is read as JSON (and one
    # labelled as a form, as `curl -d` sends it, by FormBodyAsJsonMiddleware).
    app = FastAPI(
        title="hybridllm", version=server_version(), lifespan=lifespan, strict_content_type=False
    )
    install_error_handlers(app)
    add_middlewares(
        app,
        engine.metrics,
        options.api_key,
        options.max_request_bytes,
        options.request_read_timeout,
        options.max_header_bytes,
    )
    shared = dict(tokenizer_pool=tokenizer_pool, limits=options.limits, tokens=tokens)
    completion = OpenAIServingCompletion(engine, tokenizer, model, **shared)
    chat = OpenAIServingChat(
        engine,
        tokenizer,
        model,
        parsing=options.parsing,
        tool_choice_enforcer=tool_choice_enforcer,
        **shared,
    )
    tokenization = OpenAIServingTokenization(engine, tokenizer, model, chat=chat, **shared)
    embedding = OpenAIServingEmbedding(engine, tokenizer, model, options.pooling, **shared)
    messages_api = AnthropicServingMessages(chat)  # Anthropic's Messages API, run as chats
    responses_api = OpenAIServingResponses(chat)  # OpenAI's Responses API, run as chats
    card = ModelCard(
        id=model.names[0], root=model.root or model.path, max_model_len=model.max_model_len
    )

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        # The first line only: a worker's traceback is in the log, not for every prober.
        return error_response(engine_dead_message(engine.dead_reason), 503, code="engine_dead")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": server_version()})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await engine.get_stats()
        text = engine.metrics.render(stats, engine.is_healthy, engine.num_in_flight)
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

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

    @app.post("/v1/messages")
    async def create_message(raw: Request) -> Response:
        return await messages_api.create_message(raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw: Request) -> Response:
        return await messages_api.count_tokens(raw)

    @app.post("/v1/responses")
    async def create_response(raw: Request) -> Response:
        return await responses_api.create_response(raw)

    @app.post("/tokenize")
    async def tokenize(body: Any = Body(...)) -> JSONResponse:
        response = await tokenization.create_tokenize(parse_tokenize_request(body))
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.create_detokenize(request)).model_dump())

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await embedding.create_embedding(request, raw)

    add_web_routes(app, engine, plan_report, options.ui)
    return app


def served_model_names(
    args_names: list[str] | None, model_path: str, embedded: bool = False
) -> tuple[str, ...]:
    if args_names:
        return tuple(args_names)
    if embedded:  # not the file name inside site-packages
        return (embedded_model_name(),)
    return (os.path.basename(model_path.rstrip("/")) or model_path,)


def served_plan_report(engine_args: EngineArgs, config: Any) -> dict[str, Any]:
    """The report of the running engine's `config` (its plan, its resolved speculative
    config) on this machine, as `hybridllm plan --json`."""
    from hybridllm.plan.hardware_profile import load_or_measure_profile
    from hybridllm.plan.report import build_plan_report
    from hybridllm.platforms.discovery import discover_hardware

    plan = config.plan
    if any(stage.node is not None for stage in plan.stages):
        from hybridllm.executor import ray_cluster
        from hybridllm.plan.cluster import cluster_hardware

        nodes = ray_cluster.cluster_nodes()
        hw = cluster_hardware(nodes)
    else:
        nodes, hw = None, discover_hardware()
    profile = load_or_measure_profile(hw)
    report = build_plan_report(
        engine_args,
        hw,
        profile,
        context_len=1024,
        plan=plan,
        nodes=nodes,
        speculative_config=config.speculative_config,
    )
    return report.to_dict()


def warn_if_exposed(options: ServerOptions) -> None:
    if options.exposed_without_key:
        logger.warning(
            "listening on %s without an API key: anyone who can reach this address can use "
            "the model; set --api-key (or $HYBRIDLLM_API_KEY) or bind 127.0.0.1",
            options.host,
        )


def run_server(
    options: ServerOptions,
    engine_args: EngineArgs,
    served_model_name: list[str] | None = None,
) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM: running requests get
    `shutdown_timeout` to finish, the rest are failed with an answer, and the engine stops
    within its shutdown bound (workers and shared memory freed) before the process exits.
    `served_model_name`: the names clients use (default: the model path's basename)."""
    import asyncio

    import uvicorn

    from hybridllm.engine.llm_engine import LLMEngine
    from hybridllm.entrypoints.openai.http_protocol import header_timeout_protocol

    warn_if_exposed(options)
    async_engine = AsyncEngine.launch(lambda: LLMEngine.from_engine_args(engine_args))
    engine = async_engine.engine
    config = engine.model_config
    embedded = engine_args.model is None
    names = served_model_names(served_model_name, config.model, embedded)
    model = ServedModel(
        names=names,
        path=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
        root=embedded_model_name() if embedded else None,
    )
    # The engine thread detokenizes with its tokenizer; the event loop gets its own copy.
    tokenizer = copy.deepcopy(engine.get_tokenizer())
    app = build_app(
        async_engine,
        tokenizer,
        model,
        options,
        enforce_tool_choice,
        plan_report=lambda: served_plan_report(engine_args, engine.config),
    )
    logger.info(
        "listening on http://%s:%d (model '%s')", options.host, options.port, model.names[0]
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_config=None,  # keep our logging setup
        access_log=False,  # AccessLogMiddleware writes one line per request, with latency
        # A fallback: on the first exit signal the engine drains (below) and fails what is
        # still running by `shutdown_timeout`; the margin is for those answers to go out.
        timeout_graceful_shutdown=options.shutdown_timeout + _ANSWER_MARGIN_S,
        lifespan="on",
        # Our h11 subclass adds the header deadline; h11 (not httptools) also bounds headers.
        http=header_timeout_protocol(options.request_read_timeout),
        h11_max_incomplete_event_size=options.max_header_bytes,
        limit_concurrency=options.limit_concurrency,
        timeout_keep_alive=options.timeout_keep_alive,
    )
    server = uvicorn.Server(uvicorn_config)
    failures: list[BaseException] = []

    def exit_on_engine_failure(exc: BaseException) -> None:
        # In-flight requests were failed already; a server that lingers answering 503 is
        # never restarted, so leave and let systemd, Docker or Kubernetes start a new one.
        logger.critical(
            "the engine failed (%s); shutting down with exit status %d so that a supervisor "
            "restarts the server",
            type(exc).__name__,
            EXIT_ENGINE_FAILED,
        )
        failures.append(exc)
        server.should_exit = True

    async_engine.on_fatal = exit_on_engine_failure
    uvicorn_handle_exit = server.handle_exit
    draining: list[asyncio.Future] = []  # holds the drain task until it ends

    def handle_exit(sig: int, frame: Any) -> None:
        # uvicorn waits for open connections before it ends the lifespan (which shuts the
        # engine down) and cuts them mid-body when its graceful timeout runs out: drain from
        # the first signal instead, so that running requests get `shutdown_timeout` to finish
        # and the rest are failed with an answer (a stream's error event, then its end).
        first = not server.should_exit
        uvicorn_handle_exit(sig, frame)
        if not first:
            return
        try:
            loop = asyncio.get_running_loop()  # this handler runs on the loop's thread
        except RuntimeError:
            return  # not serving yet: uvicorn's own handling is all there is to do

        def drain() -> None:
            draining.append(asyncio.ensure_future(async_engine.shutdown(options.shutdown_timeout)))

        loop.call_soon_threadsafe(drain)  # safe from a signal handler, unlike create_task

    server.handle_exit = handle_exit  # uvicorn installs it as the SIGINT/SIGTERM handler
    server.run()
    if failures:
        sys.exit(EXIT_ENGINE_FAILED)
