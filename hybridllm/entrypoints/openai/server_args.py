"""`hybridllm serve`'s server flags, and the `ServerOptions` they make (the app takes no argparse)."""

from __future__ import annotations

import argparse
import dataclasses

from hybridllm import envs
from hybridllm.entrypoints.logging_config import LOG_LEVELS
from hybridllm.entrypoints.openai.api_server import ServerOptions
from hybridllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from hybridllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS


def add_server_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's own flags (the engine's come from EngineArgs.add_cli_args)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=ServerOptions.host,
        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)",
    )
    g.add_argument("--port", type=int, default=ServerOptions.port, help="TCP port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYBRIDLLM_API_KEY)",
    )
    g.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="serve no web page at / (the page: chat, the placement plan and live rates; its "
        "data comes from /v1/*, behind --api-key)",
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
        default=ServerOptions.pooling,
        help="how /v1/embeddings pools the final hidden states (default last)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=ServerOptions.max_request_bytes,
        help="larger request bodies are refused with 413 (default 8 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServerOptions.shutdown_timeout,
        help="seconds running requests get to finish after SIGINT/SIGTERM (default 10)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own `chat_template` (sandboxed Jinja; it runs on the server's "
        "tokenizer thread, so only for trusted clients); without it the field is a 400",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="parse tool calls out of replies for tool_choice 'auto' (the default when a "
        "request has tools): hermes = <tool_call>{json}</tool_call> blocks (Qwen2.5, Qwen3, "
        'Hermes); llama3_json = Llama 3\'s {"name", "parameters"} JSON. Without it, '
        "tool_choice 'auto' is a 400",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reply's <think>...</think> block into reasoning_content: qwen3 (only "
        "when the reply opens with <think>) or deepseek_r1 (reasoning from the first token)",
    )
    limits = parser.add_argument_group(
        "request limits", "refused with a 400 naming the field, before anything is queued"
    )
    limits.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=ServerOptions.max_prompts_per_request,
        help=f"prompts in one /v1/completions request (default "
        f"{ServerOptions.max_prompts_per_request})",
    )
    limits.add_argument(
        "--max-request-work",
        type=int,
        default=ServerOptions.max_request_work,
        help=f"n x prompts of one request (default {ServerOptions.max_request_work})",
    )
    limits.add_argument(
        "--max-stop-strings",
        type=int,
        default=ServerOptions.max_stop_strings,
        help=f"stop strings per request (default {ServerOptions.max_stop_strings})",
    )
    limits.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=ServerOptions.max_stop_string_chars,
        help=f"characters per stop string (default {ServerOptions.max_stop_string_chars})",
    )
    limits.add_argument(
        "--max-chat-messages",
        type=int,
        default=ServerOptions.max_chat_messages,
        help=f"messages per chat request (default {ServerOptions.max_chat_messages})",
    )
    conn = parser.add_argument_group("connection limits")
    conn.add_argument(
        "--limit-concurrency",
        type=int,
        default=ServerOptions.limit_concurrency,
        help="open connections and requests at once; more get 503 (default 1024)",
    )
    conn.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=ServerOptions.timeout_keep_alive,
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    conn.add_argument(
        "--max-header-bytes",
        type=int,
        default=ServerOptions.max_header_bytes,
        help="headers larger than this get a 431 (default 16 KiB)",
    )
    conn.add_argument(
        "--request-read-timeout",
        type=float,
        default=ServerOptions.request_read_timeout,
        help="seconds for a request's headers to arrive, and for each piece of its body; "
        "slower clients get 408 (default 30)",
    )
    g.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="logging level (default: $HYBRIDLLM_LOGGING_LEVEL or info)",
    )
    return parser


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The server's options from its flags (each flag is the option of the same name); the API
    key from $HYBRIDLLM_API_KEY when --api-key is not given."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)}
    values["api_key"] = args.api_key or envs.read(envs.API_KEY)
    return ServerOptions(**values)
