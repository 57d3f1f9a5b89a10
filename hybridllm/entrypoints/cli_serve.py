"""`hybridllm serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from hybridllm.engine_args import EngineArgs
from hybridllm.entrypoints.openai.server_args import add_server_cli_args


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions, /v1/embeddings, /v1/models, /health, /metrics, /version. "
        "SIGINT/SIGTERM give running requests up to --shutdown-timeout to finish, fail the "
        "rest (a stream gets an error event, then its end) and exit once the workers are "
        "stopped.",
    )
    add_model_arg(parser)
    add_server_cli_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridllm.entrypoints.logging_config import configure_logging
    from hybridllm.entrypoints.openai.api_server import run_server
    from hybridllm.entrypoints.openai.server_args import server_options_from_args

    configure_logging(args.log_level)
    options = server_options_from_args(args)
    run_server(options, EngineArgs.from_cli_args(args), args.served_model_name)
    return 0
